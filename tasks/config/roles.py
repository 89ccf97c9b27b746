"""One section per actor role of a run: `trainer:` (the data-parallel ranks), `engines:` (the
vLLM engines) and `sandbox:` (the tool-call services). Each holds how many actors the role has,
what each asks Ray for, how often Ray restarts one, and the role's own settings; the `cluster:`
section (tasks/config/cluster.py) says only which Ray to use and how the roles meet.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field


class _Strict(BaseModel):
    # A misspelt key in a YAML file must fail loudly, not be silently ignored.
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


class TrainerConfig(ActorResources):
    """The trainer: one DeepSpeed rank per actor, on SFT and RL alike."""

    ranks: int = Field(1, ge=1)  # data-parallel ranks, one actor each
    # Training phases run while the engines and the sandbox sit idle, so they may take more
    # threads than one per process (measured on 2 cores: 2 threads, 1.7x faster SFT steps).
    threads: int = Field(1, ge=1)
    zero_stage: Literal[0, 1, 2, 3] = 2
    # Keep only each layer's input through the forward pass and recompute the rest in the
    # backward pass: activation memory from all layers' to one layer's, for about a third more
    # compute (`rstar2 plan` shows both).
    gradient_checkpointing: bool = False
    # Positions whose output-layer logits exist at once in a step: the rest wait their turn and are
    # recomputed in backward (tasks/rl/loss.py head_logprobs). At a 150K vocabulary the logits
    # are a step's largest tensor; None keeps them whole (bench/memory_bench.py measures both).
    logit_chunk_tokens: int | None = Field(None, ge=1)
    # A trainer call (an update, a checkpoint, an export) that takes longer fails the attempt.
    call_timeout_s: float = Field(600, gt=0)


class EnginesConfig(ActorResources):
    """The vLLM engines; on CPU the KV cache must always be bounded."""

    cpus: float = Field(0.5, ge=0)
    count: int = Field(1, ge=1)  # each holds tensor_parallel_size GPUs
    # Times Ray brings a dead engine back (on its node, or where its bundle is placed again when
    # the node is gone); it serves again once the trainer's weights are pushed into it.
    max_restarts: int = Field(3, ge=0)
    # Loading a policy from a directory (between stages, or to evaluate one) that takes longer
    # fails the attempt.
    load_timeout_s: float = Field(600, gt=0)
    kv_cache_gib: float = Field(0.25, gt=0)
    block_size: int = Field(32, ge=1)  # the CPU default (128) caches too coarsely for short multi-turn prompts
    max_model_len: int = Field(2048, ge=1)
    # Eager on the tiny default: torch.compile (vLLM's default; the GPU configs use it) gives a
    # CPU engine 1.2-1.8x the tokens/s (bench/rollout_bench.py), but a default run's rollouts
    # wait on tool calls and the agent loop, not the engine (docs/benchmarks.md).
    enforce_eager: bool = True
    tensor_parallel_size: int = Field(1, ge=1)
    max_num_seqs: int = Field(256, ge=1)
    gpu_memory_utilization: float = Field(0.85, gt=0, le=1)  # used on GPUs only
    # CPU only: OpenMP threads per engine, each engine actor bound to its own block of cores. Two
    # engines of one thread give 1.1-1.6x one, one engine of two threads 0.7-0.9x two of one:
    # most of a tiny model's step is vLLM's Python bookkeeping (bench/rollout_bench.py).
    threads: int = Field(1, ge=1)
    # kv_aware: admit per engine only what its KV cache holds at full length (the paper's
    # scheduler, never released); static: split every rollout evenly up front (the baseline);
    # kv_live (ours): admit on what each engine's rollouts hold now, each at least its reserve,
    # up to kv_overcommit x the engine's cache (tasks/rollout/scheduler.py).
    scheduler: Literal["kv_aware", "kv_live", "static"] = "kv_aware"
    # What kv_aware sets aside per rollout. max_length: prompt + the whole response budget (the
    # paper; no engine can overflow). observed (ours): kv_headroom x the mean size of the
    # previous batch's rollouts. bench/scheduler_sim.py, 3 seeds, at 419K KV tokens an engine
    # (Qwen3-14B in the paper config's 64 GiB): steps 27-32% shorter than static (the paper's
    # rule: 7-14%), no preemptions; at 850K (a whole 192 GB GPU) 3-5% longer than static (the
    # paper's: 19-22%). On the tiny CPU pool both lose to static (docs/benchmarks.md).
    kv_reserve: Literal["max_length", "observed"] = "max_length"
    kv_headroom: float = Field(1.3, ge=1.0)
    # kv_live: how far past its KV cache an engine is planned, its own scheduler preempting
    # what overflows. 1 where a preemption's recompute is dear (a large model on a GPU: the paper
    # config); more where it is cheap (a small model whose decode step costs about the same for 4
    # or 20 sequences). Chosen by bench/rollout_bench.py and bench/scheduler_sim.py.
    kv_overcommit: float = Field(1.0, ge=1.0)


class SandboxConfig(ActorResources):
    """The sandbox: replicas of the tool-call service, each running programs in isolated cells."""

    cpus: float = Field(0.5, ge=0)
    replicas: int = Field(1, ge=1)  # services; ignored when `urls` names some
    max_restarts: int = Field(3, ge=0)  # as for engines; a replica needs no state to rejoin
    urls: list[str] = []  # services already running; empty: the run starts its replicas
    workers: int = Field(4, ge=1)  # programs one replica runs at once
    program_timeout_s: float = Field(4.0, gt=0)  # a program's wall-clock limit (release default)
    memory_mb: int = Field(256, ge=1)  # release default
    output_bytes: int = Field(1000, ge=1)  # release truncates at the service to 1000 characters
    # No replica answering for this long fails the attempt (their node is gone for good) rather
    # than train on calls that all came back `internal`.
    outage_timeout_s: float = Field(300.0, gt=0)
