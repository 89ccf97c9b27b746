"""The `cluster:` section of a run config: which Ray the run uses, and how its roles meet.

The same fields describe a 2-core laptop (a local Ray started by the run) and a 64-GPU cluster
(`address` set). How many actors each role has and what each asks for is in the role's own
section (tasks/config/roles.py): one trainer actor per data-parallel rank, one actor per vLLM
engine (its tensor-parallel group inside it), one actor per sandbox replica. tasks/cluster/plan.py
turns them into a placement plan and refuses one that cannot fit.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from tasks.config.roles import _Strict


class ClusterConfig(_Strict):
    # A running Ray cluster ("auto", "host:6379" or "ray://host:10001"); None: $RAY_ADDRESS, and
    # without it a local Ray started (and stopped) by the run.
    address: str | None = None
    num_cpus: float | None = Field(None, gt=0)  # a local Ray's logical CPUs (None: this machine's cores)
    dashboard: bool = False  # a local Ray's dashboard
    # colocated: each GPU holds a trainer rank and an engine (the paper's hybrid setup; rollout
    # and update take turns). split: engines on GPUs of their own.
    placement: Literal["colocated", "split"] = "colocated"
    # How trainer rank 0 sends weights to the engines: gloo or nccl, over a process group of
    # their own (inside an engine, vLLM owns torch.distributed's default one); object_store:
    # buckets put once into Ray's shared-memory store, read by every engine. auto: gloo on CPU,
    # nccl for split GPUs, object_store for colocated GPUs (NCCL refuses two members on one GPU).
    weight_sync: Literal["auto", "gloo", "nccl", "object_store"] = "auto"
    weight_sync_bucket_mb: float = Field(64, gt=0)
    weight_sync_timeout_s: float = Field(600, gt=0)  # a weight push that takes longer fails the step
    # Forming the sync group, or moving one bucket, that takes longer fails that try of the push:
    # an engine that dies mid-transfer can leave its peers waiting on it until then.
    weight_sync_bucket_timeout_s: float = Field(60, gt=0)
    startup_timeout_s: float = Field(600, gt=0)  # placement groups and actors must be up by then
    # Times Prefect retries a failed attempt of the stages on the cluster (SFT, RL, evaluation)
    # with new actors, going on from what finished: a dead trainer rank or a lost node costs a
    # retry, not the run.
    flow_retries: int = Field(1, ge=0)
