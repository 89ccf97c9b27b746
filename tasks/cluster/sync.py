"""Weight sync: from trainer rank 0 straight to every engine, bucketed, with a timeout.

The driver only starts the transfer: the weights go from rank 0 to the engines over a gloo
(CPU) or NCCL (GPU) group of their own, or through Ray's object store (rank 0 puts each bucket
once; engines on a node read it from shared memory). ZeRO-3 ranks all take part, since the
full weights must be gathered before rank 0 can send them.
"""

from __future__ import annotations

import time

import ray
import torch

from tasks.cluster.engines import EngineGroup
from tasks.cluster.trainers import TrainerGroup
from tasks.cluster.weights import BucketLayout, SyncGroup, bucket_size
from tasks.config.cluster import ClusterConfig


def sync_backend(cfg: ClusterConfig) -> str:
    """auto: gloo on CPU; NCCL between GPUs of their own (split); colocated on GPUs, the object
    store, since NCCL refuses two ranks of one group on the same GPU (CUDA IPC handles would
    skip the copy through host memory: not written yet)."""
    if cfg.weight_sync != "auto":
        return cfg.weight_sync
    if not torch.cuda.is_available():
        return "gloo"
    return "object_store" if cfg.placement == "colocated" else "nccl"


class WeightSync:
    def __init__(self, trainer: TrainerGroup, engines: EngineGroup, cfg: ClusterConfig):
        self.trainer, self.engines, self.cfg = trainer, engines, cfg
        self.backend = sync_backend(cfg)
        self._layouts: list[BucketLayout] | None = None
        self._group_ready = False
        self.last = {"bytes": 0, "seconds": 0.0}

    def _get(self, refs: list) -> list:
        try:
            return ray.get(refs, timeout=self.cfg.sync_timeout_s)
        except ray.exceptions.GetTimeoutError:
            raise TimeoutError(
                f"weight sync ({self.backend}) took over cluster.sync_timeout_s = {self.cfg.sync_timeout_s:.0f} s"
            ) from None

    def _join(self) -> None:
        """The sync group: trainer rank 0 (which hosts its store) and the engines, once."""
        host, port = ray.get(self.trainer.actors[0].rendezvous.remote())
        group = SyncGroup(host, port, 1 + self.engines.count, self.backend, self.cfg.sync_timeout_s)
        self._get(
            [self.trainer.actors[0].join_sync_group.remote(group)]
            + [engine.join_sync_group.remote(group, 1 + i) for i, engine in enumerate(self.engines.actors)]
        )
        self._group_ready = True

    def push(self) -> dict:
        """The trainer's current weights into every engine; returns bytes sent and seconds."""
        started = time.perf_counter()
        ranks, engines = self.trainer.actors, self.engines.actors
        if self._layouts is None:
            bucket_bytes = int(self.cfg.sync_bucket_mb * 2**20)
            self._layouts = self._get([rank.weight_layouts.remote(bucket_bytes) for rank in ranks])[0]
        if self.backend == "object_store":
            buckets = self._get([rank.put_weights.remote(self._layouts) for rank in ranks])[0]
            self._get([engine.load_from_store.remote(buckets) for engine in engines])
            sent = sum(bucket_size(layout) for layout, _ in buckets)
        else:
            if not self._group_ready:
                self._join()
            sent = self._get(
                [rank.broadcast_weights.remote(self._layouts) for rank in ranks]
                + [engine.receive_weights.remote(self._layouts) for engine in engines]
            )[0]
        self.last = {"bytes": sent, "seconds": time.perf_counter() - started}
        return self.last
