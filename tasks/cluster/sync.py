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

from tasks.cluster.engines import ACTOR_GONE, EngineGroup
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
        self._members: list[int] | None = None  # the engines in the sync group
        self.last = {"bytes": 0, "seconds": 0.0}

    def _from_ranks(self, refs: list) -> list:
        """One call's results from every trainer rank, in rank order."""
        outcomes = self._outcomes(refs)
        self._raise_for_ranks(outcomes)
        if failures := _failures(outcomes):
            raise failures[0]
        return outcomes

    def _raise_for_ranks(self, outcomes: list) -> None:
        """A trainer rank gone mid-push fails the attempt as it would mid-update (RankDied, named):
        unlike an engine, a rank is not dropped and pushed around, its retry restarts the ranks."""
        for rank, outcome in enumerate(outcomes[: len(self.trainer.actors)]):
            if isinstance(outcome, ray.exceptions.RayActorError):
                raise self.trainer.died(rank, outcome) from None

    def _timeout(self) -> TimeoutError:
        return TimeoutError(
            f"weight sync ({self.backend}) took over "
            f"cluster.weight_sync_timeout_s = {self.cfg.weight_sync_timeout_s:.0f} s"
        )

    def _outcomes(self, refs: list) -> list:
        """Each call's result, or the exception it raised: one dead engine must not hide what
        the others did."""
        ready, waiting = ray.wait(refs, num_returns=len(refs), timeout=self.cfg.weight_sync_timeout_s)
        if waiting:
            raise self._timeout()
        outcomes = []
        for ref in refs:
            try:
                outcomes.append(ray.get(ref))
            except ray.exceptions.RayError as error:
                outcomes.append(error)
        return outcomes

    def _join(self, engines: list[int]) -> list:
        """A sync group of trainer rank 0 (which hosts its store) and these engines; made again
        when an engine rejoins or leaves, since a gloo or NCCL group cannot change its members.
        Returns each member's outcome, rank 0's first."""
        host, port = self._from_ranks([self.trainer.actors[0].rendezvous.remote()])[0]
        group = SyncGroup(host, port, 1 + len(engines), self.backend, self.cfg.weight_sync_bucket_timeout_s)
        actors = self.engines.actors
        outcomes = self._outcomes(
            [self.trainer.actors[0].join_sync_group.remote(group)]
            + [actors[e].join_sync_group.remote(group, 1 + i) for i, e in enumerate(engines)]
        )
        self._members = None if _failures(outcomes) else engines
        return outcomes

    def _send(self, engines: list[int], version: int) -> tuple[int, list]:
        """The weights into these engines: bytes sent, and each call's outcome (trainer ranks'
        first, then the engines' in order)."""
        ranks, actors = self.trainer.actors, [self.engines.actors[e] for e in engines]
        if self._layouts is None:
            bucket_bytes = int(self.cfg.weight_sync_bucket_mb * 2**20)
            self._layouts = self._from_ranks([rank.weight_layouts.remote(bucket_bytes) for rank in ranks])[0]
        if self.backend == "object_store":
            buckets = self._from_ranks([rank.put_weights.remote(self._layouts) for rank in ranks])[0]
            sent = sum(bucket_size(layout) for layout, _ in buckets)
            loads = [a.load_from_store.remote(buckets, version) for a in actors]
            return sent, [None] * len(ranks) + self._outcomes(loads)
        if self._members != engines:
            outcomes = self._join(engines)
            if _failures(outcomes):
                return 0, outcomes[:1] + [None] * (len(ranks) - 1) + outcomes[1:]
        outcomes = self._outcomes(
            [rank.broadcast_weights.remote(self._layouts) for rank in ranks]
            + [engine.receive_weights.remote(self._layouts, version) for engine in actors]
        )
        return (0 if _failures(outcomes) else outcomes[0]), outcomes

    def push(self) -> dict:
        """The trainer's current weights into every engine that serves, and into those Ray has
        restarted since the last push (which then serve again), as the next weights version
        (refused while a rollout batch is under way); returns bytes sent and seconds.

        An engine found dead during the push is dropped from it, and the push is made again
        without it: a gloo or NCCL group fails for all its members when one dies. Ray restarts
        the engine, and a later push brings it back."""
        started = time.perf_counter()
        version = self.engines.next_weights_version()
        for _ in range(self.engines.count + 1):  # each try that fails has lost one engine more
            self.engines.check()
            back = self.engines.restarted()
            engines = sorted([e for e, serving in enumerate(self.engines.serving) if serving] + back)
            sent, outcomes = self._send(engines, version)
            self._raise_for_ranks(outcomes)
            engine_outcomes = outcomes[len(self.trainer.actors) :]
            gone = [(e, o) for e, o in zip(engines, engine_outcomes) if isinstance(o, ACTOR_GONE)]
            if not gone:
                if failures := _failures(outcomes):
                    raise failures[0]
                self.engines.rejoin(back)
                self.engines.weights_version = version
                self.last = {"bytes": sent, "seconds": time.perf_counter() - started}
                return self.last
            self._members = None
            for engine, error in gone:
                self.engines.lose(engine, error)
        raise RuntimeError(f"weight sync: engines kept dying during the push ({self.engines.count + 1} tries)")


def _failures(outcomes: list) -> list[BaseException]:
    return [o for o in outcomes if isinstance(o, BaseException)]
