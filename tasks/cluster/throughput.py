"""How long an RL step's update takes, from model FLOPs at a measured rate per GPU class. Pure.

Model FLOPs per trained token: 6N (forward and backward), 8N with gradient checkpointing (the
forward again in backward); N counts every parameter, embeddings included. The rates are what the
project's own trainer reached on real GPUs, each with its source; a GPU class not listed has no
figure, and the plan says so rather than assume one.
"""

from __future__ import annotations

from dataclasses import dataclass

from tasks.cluster.memory import rollout_tokens
from tasks.config import RunConfig


@dataclass(frozen=True)
class Rate:
    tflops: float  # model FLOP/s per GPU, 1e12
    source: str


# The trainer (DeepSpeed ZeRO-2 on one rank, bf16, torch 2.11+cu130) on random Qwen3-shaped models
# with a 151,936-token vocabulary, three rl_steps each; the best of the measured cases, the largest
# model (a 14B model's matmuls are wider still, so this is a floor for it).
MEASURED = {
    "h200": Rate(263, "one H200, a 2.03B model, 1 x 16384 tokens, gradient checkpointing (docs/benchmarks.md)"),
}


def flops_per_token(params: float, checkpointing: bool) -> float:
    return (8 if checkpointing else 6) * params


def update_seconds(cfg: RunConfig, params: float, gpu_class: str) -> tuple[float, int, Rate]:
    """The longest stage's update at most: every kept rollout of a step at its full length
    (rollout_tokens at the stage's budget), over the trainer's ranks. Returns (seconds, trained
    tokens per step, the rate used)."""
    rate = MEASURED[gpu_class]
    tokens = max(s.problems_per_step * cfg.rl.group_size * rollout_tokens(cfg, s.max_response_tokens)
                 for s in cfg.rl.stages)  # fmt: skip
    flops = tokens * flops_per_token(params, cfg.trainer.gradient_checkpointing)
    return flops / (cfg.trainer.ranks * rate.tflops * 1e12), tokens, rate
