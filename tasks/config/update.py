"""How an RL update is made: the optimizer, GRPO-RoC's selection, the loss, and how far
generation may run ahead of training (`rl.async`)."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field, field_validator

from tasks.config.roles import _Strict


class OptimConfig(_Strict):
    lr: float = Field(1e-6, gt=0)
    warmup_steps: int = Field(20, ge=0)
    schedule: Literal["constant", "cosine"] = "constant"
    weight_decay: float = Field(0.0, ge=0)
    grad_clip: float = Field(1.0, gt=0)
    betas: tuple[Annotated[float, Field(ge=0, lt=1)], Annotated[float, Field(ge=0, lt=1)]] = (0.9, 0.999)
    # AdamW's denominator floor. Adam's first update is about lr * g / (|g| + eps): with a small
    # eps every gradient, float noise included, moves its weight by ~lr; with eps far above |g|
    # the update is linear in g, as SGD's with lr / eps.
    eps: float = Field(1e-8, gt=0)
    micro_batch_size: int = Field(8, ge=1)


class RocConfig(_Strict):
    mode: Literal["paper", "release", "off"] = "paper"
    count_turns: Literal["all", "after_first_tool"] = "all"  # release: after_first_tool
    drop_zero_signal: bool = True


class LossConfig(_Strict):
    eps_low: float = Field(0.2, ge=0, lt=1)
    eps_high: float = Field(0.28, ge=0)
    dual_clip: float = Field(3.0, gt=1)
    # Scales the loss of rollouts with a negative advantage (the paper: 1). Token-mean sums tokens,
    # and wrong rollouts are the long ones, so at 1 pushing down outweighs pulling up; on the tiny
    # default that raised entropy and tool errors over stage 1 (docs/experiments.md).
    negative_weight: float = Field(1.0, ge=0.0, le=1.0)
    # Truncated importance sampling (decoupled PPO): each token weighted by
    # min(pi_trainer / pi_engine, is_cap), pi_engine the log-probs the engine sampled it with. It
    # corrects rollouts drawn by other weights or other kernels than the update's starting
    # policy. None: the update's own log-probs stand for the engine's (the paper).
    is_cap: float | None = Field(None, ge=1.0)
    # Over the cap: truncate the weight to it (verl's truncated IS, the default), or mask the token
    # out of the loss (AReaL's decoupled PPO). docs/async.md compares them.
    is_mode: Literal["truncate", "mask"] = "truncate"


class AsyncConfig(_Strict):
    """How far generation may run ahead of training (the `rl.async` section).

    off: a step's rollouts come from the weights the step trains (on-policy). one_step: while step
    t's update runs, the engines roll out step t+1 on step t's weights. bounded: the same, and
    while the update still runs the engines go on into later steps, as long as no rollout is
    trained more than `max_staleness` policy versions after the one that drew it; older rollouts
    (kept across a resume, say) are dropped, counted and drawn again. No rollout spans a weight
    push: the push waits for the rollouts in flight, so each is drawn by one policy version.
    """

    mode: Literal["off", "one_step", "bounded"] = "off"
    max_staleness: int = Field(2, ge=1)  # bounded only

    @field_validator("mode", mode="before")
    @classmethod
    def _yaml_off(cls, mode: object) -> object:
        return "off" if mode is False else mode  # YAML reads a bare `off` as false

    @property
    def staleness_limit(self) -> int:
        """The most policy versions a trained rollout may lag behind the update."""
        return {"off": 0, "one_step": 1, "bounded": self.max_staleness}[self.mode]
