"""Weights in buckets, and the groups that carry them from trainer rank 0 to the engines.

A bucket is one flat byte tensor holding whole parameters (any dtype, bf16 included) plus a
layout: name, dtype, shape and byte offset of each. Buckets bound the memory a sync needs on
either side to about one bucket, whatever the model's size.

Inside an engine actor vLLM has already made torch.distributed's default group its own (gloo,
world size 1), so the sync group is a process group built directly on a TCP store (rank 0 =
trainer rank 0, ranks 1.. = the engines), needing no default group: gloo on CPU, NCCL on GPUs.
"""

from __future__ import annotations

import datetime
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import torch

BucketLayout = list[tuple[str, str, tuple[int, ...], int, int]]  # name, dtype, shape, offset, bytes


def bucket_layouts(named_tensors: Iterable[tuple[str, torch.Tensor]], bucket_bytes: int) -> list[BucketLayout]:
    """Parameters grouped in order into buckets of at most `bucket_bytes` (a bigger tensor gets
    a bucket to itself)."""
    layouts: list[BucketLayout] = [[]]
    size = 0
    for name, tensor in named_tensors:
        nbytes = tensor.numel() * tensor.element_size()
        if layouts[-1] and size + nbytes > bucket_bytes:
            layouts.append([])
            size = 0
        layouts[-1].append((name, str(tensor.dtype).removeprefix("torch."), tuple(tensor.shape), size, nbytes))
        size += nbytes
    return [layout for layout in layouts if layout]


def bucket_size(layout: BucketLayout) -> int:
    name, dtype, shape, offset, nbytes = layout[-1]
    return offset + nbytes


def pack_bucket(tensors: dict[str, torch.Tensor], layout: BucketLayout, device: str | torch.device) -> torch.Tensor:
    flat = torch.empty(bucket_size(layout), dtype=torch.uint8, device=device)
    for name, _, _, offset, nbytes in layout:
        if nbytes:
            flat[offset : offset + nbytes] = tensors[name].detach().contiguous().view(-1).view(torch.uint8)
    return flat


def unpack_bucket(flat: torch.Tensor, layout: BucketLayout) -> Iterator[tuple[str, torch.Tensor]]:
    """Views into `flat` (no copy) under their names."""
    for name, dtype, shape, offset, nbytes in layout:
        yield name, flat[offset : offset + nbytes].view(getattr(torch, dtype)).reshape(shape)


@dataclass(frozen=True)
class SyncGroup:
    """Where the sync group meets: rank 0's store, and the backend. Picklable, so the driver
    hands the same value to rank 0 and to every engine."""

    host: str
    port: int
    world_size: int
    backend: str  # "gloo" or "nccl"
    timeout_s: float

    def join(self, rank: int):
        """This process's member of the group (rank 0 hosts the store)."""
        timeout = datetime.timedelta(seconds=self.timeout_s)
        store = torch.distributed.TCPStore(self.host, self.port, self.world_size, rank == 0, timeout=timeout)
        store = torch.distributed.PrefixStore("weight-sync", store)
        if self.backend == "nccl":
            return torch.distributed.ProcessGroupNCCL(store, rank, self.world_size)
        return torch.distributed.ProcessGroupGloo(store, rank, self.world_size, timeout)

    @property
    def device(self) -> str:
        return "cuda" if self.backend == "nccl" else "cpu"


def broadcast(group, flat: torch.Tensor) -> None:
    """Send (rank 0) or receive (the others) one bucket, in place."""
    options = torch.distributed.BroadcastOptions()
    options.rootRank = 0
    group.broadcast([flat], options).wait()
