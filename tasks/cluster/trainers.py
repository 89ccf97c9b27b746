"""The policy trainer as data-parallel rank actors, driven like one trainer.

Each rank actor runs the project's DeepSpeed trainer (tasks/train/trainer.py) in a
torch.distributed group the driver sets up: rank 0's actor picks its node's address and a free
port, every rank gets RANK / WORLD_SIZE / MASTER_ADDR / MASTER_PORT, and all of them initialise
together. A step's global batch is dealt out by length, so the shares hold similar token counts;
the trainer's token-mean runs over the global batch, so any split gives one rank's gradient.
"""

from __future__ import annotations

import gc
import os
import time
from pathlib import Path

import ray
import torch

from tasks.cluster.connect import node_address, placement_record
from tasks.cluster.weights import BucketLayout, SyncGroup, broadcast, bucket_layouts, pack_bucket
from tasks.config import LossConfig, OptimConfig, TrainerConfig
from tasks.records import Sample
from tasks.rollout.engine import available_cores, split_cores
from tasks.train.distributed import free_port
from tasks.train.trainer import Trainer, by_length


class TrainerActor:
    """The body of one rank actor."""

    def __init__(self, rank: int, world_size: int, split: int = 0):
        """`split` > 0: split placement on CPU, the node's first `split` cores are the engines' and
        the rank runs on the others."""
        self.rank, self.world_size = rank, world_size
        if split and not torch.cuda.is_available() and hasattr(os, "sched_setaffinity"):
            os.sched_setaffinity(0, split_cores(available_cores(), split)[1])
        self.trainer: Trainer | None = None
        self._sync_group = None

    def where(self) -> dict:
        return placement_record("trainer", self.rank)

    def rendezvous(self) -> tuple[str, int]:
        """Rank 0: the address and a free port of its node, for the trainer group."""
        host = node_address()
        return host, free_port(host)

    def start(
        self,
        master: tuple[str, int],
        model_dir: str,
        optim: dict,
        total_steps: int,
        dtype: str,
        seed: int,
        threads: int,
        zero_stage: int,
        gradient_checkpointing: bool,
        logit_chunk_tokens: int | None,
    ):
        os.environ.pop("RSTAR2_OWN_GROUP_PORT", None)  # values a launcher (this driver) chose
        os.environ.update(
            {
                "MASTER_ADDR": master[0],
                "MASTER_PORT": str(master[1]),
                "RANK": str(self.rank),
                "WORLD_SIZE": str(self.world_size),
                "LOCAL_RANK": "0",  # Ray shows each rank actor only its own GPU(s)
            }
        )
        self.trainer = None  # the previous one's memory goes before the next one's arrives
        gc.collect()
        self.trainer = Trainer(
            Path(model_dir),
            OptimConfig(**optim),
            total_steps,
            dtype,
            seed,
            threads,
            zero_stage,
            gradient_checkpointing,
            logit_chunk_tokens,
        )

    def rl_step(self, samples: list[Sample], loss: dict, temperature: float) -> tuple[dict, float]:
        return self.trainer.rl_step(samples, LossConfig(**loss), temperature), self.fingerprint()

    def fingerprint(self) -> float | None:
        """The sum of squares of this rank's weights: the same on every rank after a step when
        each holds full weights (ZeRO 0-2), so a rank that drifted shows. None where there is
        nothing to compare (one rank, or ZeRO-3's partitions)."""
        if self.world_size == 1 or self.trainer.zero_stage == 3:
            return None
        with torch.no_grad():
            return sum(p.double().square().sum().item() for p in self.trainer.engine.module.parameters())

    def sft_step(self, samples: list[Sample]) -> tuple[dict, float]:
        return self.trainer.sft_step(samples), self.fingerprint()

    def token_logprobs(self, samples: list[Sample]) -> list[list[float]]:
        return self.trainer.token_logprobs(samples)

    def save_checkpoint(self, directory: str, tag: str, client_state: dict) -> None:
        self.trainer.save_checkpoint(Path(directory), tag, client_state)

    def load_checkpoint(self, directory: str, tag: str | None, weights_only: bool) -> dict:
        return self.trainer.load_checkpoint(Path(directory), tag, weights_only)

    def save_pretrained(self, directory: str) -> None:
        self.trainer.save_pretrained(Path(directory))

    def parameters(self) -> dict:
        """The full weights on this rank (tests compare ranks with these)."""
        return {name: tensor.clone() for name, tensor in self.trainer.named_weights()}

    # -- weight sync: rank 0 sends, every rank takes part in gathering (ZeRO-3) -------------------

    def weight_layouts(self, bucket_bytes: int) -> list[BucketLayout]:
        return bucket_layouts(self.trainer.named_weights(), bucket_bytes)

    def join_sync_group(self, group: SyncGroup) -> None:
        if self.rank == 0:
            self._sync_group = (group, group.join(0))

    def broadcast_weights(self, layouts: list[BucketLayout]) -> int:
        """Send the weights to the engines bucket by bucket; returns the bytes sent."""
        weights = dict(self.trainer.named_weights())
        if self.rank != 0:
            return 0
        group, members = self._sync_group
        sent = 0
        for layout in layouts:
            flat = pack_bucket(weights, layout, group.device)
            broadcast(members, flat)
            sent += flat.numel()
        return sent

    def put_weights(self, layouts: list[BucketLayout]) -> list[tuple[BucketLayout, ray.ObjectRef]]:
        """The weights as buckets in Ray's object store (rank 0; once, whatever the engines)."""
        weights = dict(self.trainer.named_weights())
        if self.rank != 0:
            return []
        # References nested in a value travel unresolved: the driver never fetches the bytes.
        return [(layout, ray.put(pack_bucket(weights, layout, "cpu").numpy())) for layout in layouts]


class RankDied(RuntimeError):
    """A trainer rank's actor is gone: the step cannot finish (its peers wait on it in a
    collective), so the attempt fails; a retry starts new ranks from the last checkpoint."""


class TrainerGroup:
    """The rank actors, with the trainer's interface: a call runs on every rank."""

    def __init__(self, actors: list, timeout_s: float):
        self.actors, self.timeout_s = actors, timeout_s
        self.where: list[dict] = []  # each rank's node, as placed (for naming a rank that died)

    @property
    def world_size(self) -> int:
        return len(self.actors)

    def _get(self, refs: list) -> list:
        """Every rank's result; the first rank whose actor dies fails the call at once, named
        with its node and cause, instead of its peers hanging in a collective until a timeout."""
        waiting, deadline = dict(zip(refs, range(len(refs)))), time.monotonic() + self.timeout_s
        while waiting:
            ready, _ = ray.wait(list(waiting), num_returns=1, timeout=max(0.0, deadline - time.monotonic()))
            if not ready:
                raise TimeoutError(
                    f"trainer ranks {sorted(waiting.values())} gave no answer within {self.timeout_s:.0f} s"
                )
            rank = waiting.pop(ready[0])
            try:
                ray.get(ready[0])
            except ray.exceptions.RayActorError as error:
                raise self.died(rank, error) from None
        return ray.get(refs)

    def died(self, rank: int, error: ray.exceptions.RayActorError) -> RankDied:
        """The error for a rank whose actor is gone, named with its node, pid and cause."""
        place = next((w for w in self.where if w["index"] == rank), None)
        node = f"node {place['node_id'][:12]} ({place['node_ip']}), pid {place['pid']}" if place else "unknown node"
        lines = [line.strip() for line in str(error).splitlines() if line.strip()]
        cause = next((line for line in lines if "exit detail" in line.lower()), lines[0])[:300]
        return RankDied(f"trainer rank {rank} on {node} died: {cause}")

    def _all(self, method: str, *args) -> list:
        return self._get([getattr(actor, method).remote(*args) for actor in self.actors])

    def start(
        self, model_dir: Path, optim: OptimConfig, total_steps: int, dtype: str, seed: int, role: TrainerConfig
    ) -> TrainerGroup:
        """Every rank starts a trainer on `model_dir` (threads and ZeRO stage from the `trainer:`
        section)."""
        (master,) = self._get([self.actors[0].rendezvous.remote()])
        self._all(
            "start",
            master,
            str(model_dir),
            optim.model_dump(),
            total_steps,
            dtype,
            seed,
            role.threads,
            role.zero_stage,
            role.gradient_checkpointing,
            role.logit_chunk_tokens,
        )
        return self

    def shares(self, samples: list[Sample]) -> list[list[Sample]]:
        """The global batch dealt out longest first, so every rank gets about as many tokens."""
        ordered = by_length(samples)
        return [ordered[rank :: self.world_size] for rank in range(self.world_size)]

    def _each(self, method: str, shares: list, *args) -> list:
        return self._get([getattr(a, method).remote(share, *args) for a, share in zip(self.actors, shares)])

    def _step(self, method: str, samples: list[Sample], *args) -> dict:
        """One update on the global batch; with several ranks holding full weights, also the
        spread of their weights' fingerprints (0 when every rank holds the same weights)."""
        results = self._each(method, self.shares(samples), *args)
        metrics = dict(results[0][0])
        fingerprints = [fingerprint for _, fingerprint in results]
        if None not in fingerprints:
            metrics["rank_weight_spread"] = max(fingerprints) - min(fingerprints)
        return metrics

    def rl_step(self, samples: list[Sample], loss: LossConfig, temperature: float = 1.0) -> dict:
        return self._step("rl_step", samples, loss.model_dump(), temperature)

    def sft_step(self, samples: list[Sample]) -> dict:
        return self._step("sft_step", samples)

    def token_logprobs(self, samples: list[Sample]) -> list[list[float]]:
        return self._all("token_logprobs", samples)[0]

    def save_checkpoint(self, directory: Path, tag: str, client_state: dict | None = None) -> None:
        self._all("save_checkpoint", str(directory), tag, client_state or {})

    def load_checkpoint(self, directory: Path, tag: str | None = None, weights_only: bool = False) -> dict:
        return self._all("load_checkpoint", str(directory), tag, weights_only)[0]

    def save_pretrained(self, directory: Path) -> Path:
        self._all("save_pretrained", str(directory))
        return Path(directory)

    def parameters(self) -> list[dict]:
        return self._all("parameters")

    def stop(self) -> None:
        for actor in self.actors:
            ray.kill(actor)
        self.actors = []
