"""The `cluster:` section of a run config: where the run's actors go on Ray.

The same fields describe a 2-core laptop (a local Ray started by the run) and a 64-GPU cluster
(`address` set): one trainer actor per data-parallel rank, one actor per vLLM engine (its
tensor-parallel group inside it), one actor per sandbox replica. tasks/cluster/plan.py turns
this section into a placement plan and refuses one that cannot fit.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class ActorResources(_Strict):
    """What each actor of a role asks Ray for. CPUs are Ray's logical CPUs: on a laptop the
    roles take turns on the same cores (engines idle while the trainer steps), so fractions
    are the honest request."""

    cpus: float = Field(1.0, ge=0)
    gpus: float = Field(0.0, ge=0)
    # Custom Ray resources a node must offer, e.g. {"gpu_node": 1}: keeps a role on the nodes
    # started with them (`ray start --resources '{"gpu_node": 8}'`).
    resources: dict[str, float] = {}


class TrainerActors(ActorResources):
    ranks: int = Field(1, ge=1)  # data-parallel ranks, one actor each


class EngineActors(ActorResources):
    count: int = Field(1, ge=1)  # vLLM engines; each holds engine.tensor_parallel_size GPUs
    # Times Ray brings a dead engine back (on its node, or where its bundle is placed again when
    # the node is gone); it serves again once the trainer's weights are pushed into it.
    max_restarts: int = Field(3, ge=0)


class SandboxActors(ActorResources):
    replicas: int = Field(1, ge=1)  # sandbox services; ignored when sandbox.urls names some
    max_restarts: int = Field(3, ge=0)  # as for engines; a replica needs no state to rejoin


class ClusterConfig(_Strict):
    # A running Ray cluster ("auto", "host:6379" or "ray://host:10001"); None: $RAY_ADDRESS, and
    # without it a local Ray started (and stopped) by the run.
    address: str | None = None
    num_cpus: float | None = None  # a local Ray's logical CPUs (None: this machine's cores)
    dashboard: bool = False  # a local Ray's dashboard
    # colocated: each GPU holds a trainer rank and an engine (the paper's hybrid setup; rollout
    # and update take turns). split: engines on GPUs of their own.
    placement: Literal["colocated", "split"] = "colocated"
    # How trainer rank 0 sends weights to the engines: gloo or nccl, over a process group of
    # their own (inside an engine, vLLM owns torch.distributed's default one); object_store:
    # buckets put once into Ray's shared-memory store, read by every engine. auto: gloo on CPU,
    # nccl for split GPUs, object_store for colocated GPUs (NCCL refuses two members on one GPU).
    weight_sync: Literal["auto", "gloo", "nccl", "object_store"] = "auto"
    sync_bucket_mb: float = Field(64, gt=0)
    sync_timeout_s: float = Field(600, gt=0)  # a weight sync that takes longer fails the step
    # Forming the sync group, or moving one bucket, that takes longer fails that try of the push:
    # an engine that dies mid-transfer can leave its peers waiting on it until then.
    sync_group_timeout_s: float = Field(60, gt=0)
    ready_timeout_s: float = Field(600, gt=0)  # placement groups and actors must be up by then
    # Times Prefect retries a failed attempt of the stages on the cluster (SFT, RL, evaluation)
    # with new actors, going on from what finished: a dead trainer rank or a lost node costs a
    # retry, not the run.
    flow_retries: int = Field(1, ge=0)
    trainer: TrainerActors = TrainerActors(cpus=1.0)
    engines: EngineActors = EngineActors(cpus=0.5)
    sandbox: SandboxActors = SandboxActors(cpus=0.5)
