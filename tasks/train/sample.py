"""One training sequence, the unit the trainer consumes (SFT, pre-training and RL alike)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Sample:
    token_ids: list[int]
    loss_mask: list[int]  # per token of token_ids: 1 where the token is a training target
    advantage: float = 0.0
