"""GRPO-RoC (Resample-on-Correct): pick G of the 2G rollouts drawn for each prompt.

rStar2-Agent (arXiv 2508.20722, section on GRPO-RoC) oversamples 2G rollouts per prompt and keeps G:

- negatives (reward 0): half of them, uniformly at random;
- positives (reward 1): half of them, sampled without replacement with probability
  proportional to 1 / p_total, where p_total = p_err + p_format penalises noisy tool use
  and repeated answers. Good-looking correct trajectories are more likely to be trained on,
  while all failure modes stay in the negatives for the model to learn from.

Modes (a config switch, so either recipe can be reproduced):

- "paper":   the recipe above.
- "release": the public release: class counts round(n_class * G / 2G) with at least 2 per class,
             negatives = the first k in generation order, positives = the k lowest-penalty ones.
- "off":     plain GRPO; the caller drew only G rollouts, so all are kept.

Everything here is pure: plain data in, plain data out, randomness only from the `rng` passed in.
"""

import math
import random
import statistics
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

Mode = Literal["paper", "release", "off"]
CountTurns = Literal["all", "after_first_tool"]

# p_total == 0 (tool calls without a single failure and exactly one answer block) would be an
# infinite weight 1/0. We use 1/max(p_total, PERFECT_EPS) instead: 1000 is far above the weight
# of any imperfect trajectory (p_total >= 1/calls or 1/turns, i.e. weight <= a few dozen), so
# perfect trajectories are drawn first, uniformly among themselves, which is the limit of the
# paper's formula, while the sampler never divides by zero.
PERFECT_EPS = 1e-3


@dataclass(frozen=True)
class TrajectoryScore:
    """What RoC needs to know about one rollout; the caller fills it from the rollout record."""

    reward: float  # 1.0 correct, 0.0 otherwise
    tool_calls: int  # number of tool calls made
    tool_failures: int  # calls whose sandbox status is a failure (parse/exec error, timeout, ...)
    answer_blocks: int  # number of <answer>...</answer> blocks in the response
    turns: int  # assistant turns
    turns_after_first_tool_response: int  # assistant turns after the first tool response


def is_positive(t: TrajectoryScore) -> bool:
    """A trajectory is positive iff reward > 0 (rewards are binary 1.0 / 0.0)."""
    return t.reward > 0.0


def p_err(t: TrajectoryScore) -> float:
    """Tool-error penalty.

    p_err = 0.5                          if tool_calls == 0
          = tool_failures / tool_calls   otherwise

    No tool call at all gets a middling 0.5: the paper does not want to reward skipping the tool,
    but it is not as bad as a trajectory whose every call failed (1.0).
    """
    if t.tool_calls <= 0:
        return 0.5
    return t.tool_failures / t.tool_calls


def p_format(t: TrajectoryScore, count_turns: CountTurns = "all") -> float:
    """Answer-format penalty.

    p_format = 1                                  if answer_blocks == 0
             = min(1, (answer_blocks - 1) / turns) otherwise

    count_turns="all" (paper, ours) uses every assistant turn. count_turns="after_first_tool"
    (release) uses only turns after the first tool response, so a rollout that never called the
    tool has 0 turns and gets p_format = 1 (the worst penalty). 0 turns always gives 1.0.
    """
    if t.answer_blocks <= 0:
        return 1.0
    turns = t.turns if count_turns == "all" else t.turns_after_first_tool_response
    if turns <= 0:
        return 1.0
    return min(1.0, (t.answer_blocks - 1) / turns)


def p_total(t: TrajectoryScore, count_turns: CountTurns = "all") -> float:
    """p_total = p_err + p_format, in [0, 2]."""
    return p_err(t) + p_format(t, count_turns)


def positive_weight(t: TrajectoryScore, count_turns: CountTurns = "all") -> float:
    """Sampling weight of a positive: w = 1 / max(p_total, PERFECT_EPS) (see PERFECT_EPS)."""
    return 1.0 / max(p_total(t, count_turns), PERFECT_EPS)


# ------------------------------------------------------------------------------------------------
# How many of each class to keep


def _clamp_positive_count(k_pos: int, n_pos: int, n_neg: int, keep: int, min_per_class: int) -> int:
    """Clamp k_pos so that k_pos + k_neg == keep, each within [min(n, min_per_class), n]."""
    lo = max(min(n_pos, min_per_class), keep - n_neg)
    hi = min(n_pos, keep - min(n_neg, min_per_class))
    if lo > hi:
        raise ValueError(
            f"cannot keep {keep} of {n_pos} positives + {n_neg} negatives with at least {min_per_class} per class"
        )
    return min(max(k_pos, lo), hi)


def paper_class_counts(n_pos: int, n_neg: int, keep: int) -> tuple[int, int]:
    """(k_pos, k_neg) for the paper: each class scaled by keep / n (halved when n == 2 * keep).

    k_pos = n_pos * keep / n rounded, k_neg = keep - k_pos. When n_pos * keep / n is not an
    integer (odd class sizes), the extra slot goes to the smaller class (positives on a tie):
    that keeps a lone positive or negative, so the group does not lose its only signal. A class
    that is present keeps at least one member.
    """
    n = n_pos + n_neg
    k_pos = (n_pos * keep) // n
    if (n_pos * keep) % n != 0 and n_pos <= n_neg:
        k_pos += 1
    k_pos = _clamp_positive_count(k_pos, n_pos, n_neg, keep, min_per_class=1)
    return k_pos, keep - k_pos


def release_class_counts(n_pos: int, n_neg: int, keep: int, min_per_class: int = 2) -> tuple[int, int]:
    """(k_pos, k_neg) for the release: k_pos = round(n_pos * keep / n), k_neg = keep - k_pos.

    Python's round (half to even) as in the release; then each class keeps at least
    min(n_class, min_per_class) members and the total is exactly keep.
    """
    n = n_pos + n_neg
    k_pos = round(n_pos * keep / n)
    k_pos = _clamp_positive_count(k_pos, n_pos, n_neg, keep, min_per_class=min_per_class)
    return k_pos, keep - k_pos


# ------------------------------------------------------------------------------------------------
# Selection


def weighted_sample_without_replacement(weights: Sequence[float], k: int, rng: random.Random) -> list[int]:
    """Draw k distinct indices by successive sampling: each draw picks a remaining index i with
    probability w_i / sum(remaining w). This is what "sampled without replacement with
    probability proportional to w" means operationally (like numpy's choice(replace=False, p=...))."""
    remaining = list(range(len(weights)))
    chosen: list[int] = []
    for _ in range(min(k, len(remaining))):
        total = sum(weights[i] for i in remaining)
        threshold = rng.random() * total
        cumulative = 0.0
        pick = len(remaining) - 1  # float round-off can leave threshold past the last sum
        for position, i in enumerate(remaining):
            cumulative += weights[i]
            if threshold < cumulative:
                pick = position
                break
        chosen.append(remaining.pop(pick))
    return chosen


def select_group(
    scores: Sequence[TrajectoryScore],
    keep: int,
    mode: Mode,
    rng: random.Random,
    count_turns: CountTurns = "all",
) -> list[int]:
    """Indices (sorted) of the rollouts of one prompt to train on.

    paper:   k_pos, k_neg = paper_class_counts(...); negatives: k_neg uniformly at random;
             positives: k_pos without replacement, P(pick i) ∝ 1 / max(p_err_i + p_format_i, eps).
    release: k_pos, k_neg = release_class_counts(...); negatives: the first k_neg in generation
             order; positives: the k_pos smallest p_total, ties broken by index.
    off:     all indices (the caller drew only G rollouts).

    A group no larger than `keep` is kept whole in every mode.
    """
    if mode not in ("paper", "release", "off"):
        raise ValueError(f"unknown RoC mode {mode!r}")
    n = len(scores)
    if mode == "off" or n <= keep:
        return list(range(n))
    positives = [i for i, t in enumerate(scores) if is_positive(t)]
    negatives = [i for i, t in enumerate(scores) if not is_positive(t)]
    if mode == "paper":
        k_pos, k_neg = paper_class_counts(len(positives), len(negatives), keep)
        kept_negatives = rng.sample(negatives, k_neg)
        weights = [positive_weight(scores[i], count_turns) for i in positives]
        kept_positives = [positives[j] for j in weighted_sample_without_replacement(weights, k_pos, rng)]
    else:  # release
        k_pos, k_neg = release_class_counts(len(positives), len(negatives), keep)
        kept_negatives = negatives[:k_neg]
        kept_positives = sorted(positives, key=lambda i: (p_total(scores[i], count_turns), i))[:k_pos]
    return sorted(kept_negatives + kept_positives)


# ------------------------------------------------------------------------------------------------
# A whole batch of groups


@dataclass(frozen=True)
class RocResult:
    """Outcome of downsample(); the float stats are NaN when there is nothing to average."""

    kept: list[list[int]]  # per group, sorted indices kept; empty for a dropped group
    dropped_zero_signal: int  # groups dropped because all rewards were equal
    kept_positives: int
    kept_negatives: int
    kept_pos_p_err: float  # mean p_err of kept positives
    kept_pos_p_format: float  # mean p_format of kept positives
    dropped_pos_p_err: float  # mean p_err of positives RoC did not keep (in groups it sampled)
    dropped_pos_p_format: float  # mean p_format of positives RoC did not keep
    kept_pos_tool_error_share: float  # fraction of kept positives with tool_failures > 0

    def metrics(self, prefix: str = "roc/") -> dict[str, float]:
        """Flat name -> value dict for a metrics logger."""
        return {
            f"{prefix}dropped_zero_signal": float(self.dropped_zero_signal),
            f"{prefix}kept_positives": float(self.kept_positives),
            f"{prefix}kept_negatives": float(self.kept_negatives),
            f"{prefix}kept_pos_p_err": self.kept_pos_p_err,
            f"{prefix}kept_pos_p_format": self.kept_pos_p_format,
            f"{prefix}dropped_pos_p_err": self.dropped_pos_p_err,
            f"{prefix}dropped_pos_p_format": self.dropped_pos_p_format,
            f"{prefix}kept_pos_tool_error_share": self.kept_pos_tool_error_share,
        }


def is_zero_signal(scores: Sequence[TrajectoryScore]) -> bool:
    """True when every reward in the group is equal (advantages would all be 0), or it is empty."""
    return len({t.reward for t in scores}) <= 1


def _mean(values: list[float]) -> float:
    return statistics.fmean(values) if values else math.nan


def downsample(
    groups: Sequence[Sequence[TrajectoryScore]],
    keep: int,
    mode: Mode,
    rng: random.Random,
    drop_zero_signal: bool = True,
    count_turns: CountTurns = "all",
) -> RocResult:
    """Apply select_group to every group, after dropping zero-signal groups.

    Zero-signal groups (all rewards equal: all correct or all wrong) give advantage 0 to every
    token, so they only dilute the token-mean; the release drops them before downsampling.
    The stats compare kept and not-kept positives of the groups RoC actually sampled, which is
    the effect RoC is meant to have (kept positives should show lower p_err / p_format).
    """
    kept: list[list[int]] = []
    dropped = 0
    kept_pos: list[TrajectoryScore] = []
    not_kept_pos: list[TrajectoryScore] = []
    kept_neg_count = 0
    for scores in groups:
        if drop_zero_signal and is_zero_signal(scores):
            kept.append([])
            dropped += 1
            continue
        indices = select_group(scores, keep, mode, rng, count_turns)
        kept.append(indices)
        chosen = set(indices)
        for i, t in enumerate(scores):
            if is_positive(t):
                (kept_pos if i in chosen else not_kept_pos).append(t)
            elif i in chosen:
                kept_neg_count += 1
    return RocResult(
        kept=kept,
        dropped_zero_signal=dropped,
        kept_positives=len(kept_pos),
        kept_negatives=kept_neg_count,
        kept_pos_p_err=_mean([p_err(t) for t in kept_pos]),
        kept_pos_p_format=_mean([p_format(t, count_turns) for t in kept_pos]),
        dropped_pos_p_err=_mean([p_err(t) for t in not_kept_pos]),
        dropped_pos_p_format=_mean([p_format(t, count_turns) for t in not_kept_pos]),
        kept_pos_tool_error_share=_mean([float(t.tool_failures > 0) for t in kept_pos]),
    )


def group_advantages(rewards: Sequence[float], eps: float = 1e-6) -> list[float]:
    """GRPO advantage of each kept rollout of one prompt: A_i = (r_i - mean(r)) / (std(r) + eps).

    std is the population std (divide by G, not G - 1): it is the std of the G kept rewards
    themselves, as written in the paper. Bessel's correction (torch.std's default, used by some
    GRPO code) only rescales every advantage by sqrt((G - 1) / G), ~0.97 at G = 16.
    All-equal rewards give all-zero advantages.
    """
    if not rewards:
        return []
    mean = statistics.fmean(rewards)
    std = statistics.pstdev(rewards)
    return [(r - mean) / (std + eps) for r in rewards]
