"""An RL step's plain data: the problems it draws, the training batch GRPO-RoC selects from its
scored trajectories (kept flags, advantages, samples), the difficulty filter's choice, and the
step's metrics.

Pure: no I/O; every random choice is seeded from (run seed, stage, step), so a rerun repeats it.
"""

from __future__ import annotations

import random
from collections import Counter

from tasks.config import RocConfig
from tasks.records import Problem, Rollouts, Sample, Trajectory
from tasks.rl.asynchrony import staleness
from tasks.rl.roc import RocResult, TrajectoryScore, downsample, group_advantages
from tasks.rollout.metrics import rollout_metrics, solved_attempts


def step_problems(problems: list[Problem], n: int, seed: int, stage: str, step: int) -> list[Problem]:
    """The step's problems: a draw that depends only on (seed, stage, step)."""
    rng = random.Random(f"{seed}/{stage}/{step}")
    return rng.sample(problems, min(n, len(problems)))


def trajectory_score(traj: Trajectory, reward: float, answer_blocks: int) -> TrajectoryScore:
    failures = sum(call.status.is_failure for call in traj.tool_calls)
    first_call_turn = traj.tool_calls[0].turn if traj.tool_calls else traj.turns
    return TrajectoryScore(
        reward=reward,
        tool_calls=len(traj.tool_calls),
        tool_failures=failures,
        answer_blocks=answer_blocks,
        turns=traj.turns,
        turns_after_first_tool_response=traj.turns - first_call_turn,
    )


class TrainingBatch:
    """The kept trajectories as training samples, plus per-trajectory kept flags and advantages.

    A plain class, not a dataclass: Prefect walks dataclasses passed to tasks element by element
    (tens of thousands of token ids here), but passes plain objects through untouched.
    """

    def __init__(self, samples: list[Sample], kept: list[bool], advantages: list[float], roc: RocResult):
        self.samples = samples
        self.kept = kept  # per trajectory, in input order
        self.advantages = advantages  # per trajectory; 0 where not kept
        self.roc = roc


def select_training_batch(
    trajectories: list[Trajectory],
    scores: list[TrajectoryScore],
    keep: int,
    roc: RocConfig,
    rng: random.Random,
) -> TrainingBatch:
    """Group by problem (in order of first appearance), downsample, compute advantages."""
    groups: dict[str, list[int]] = {}
    for index, traj in enumerate(trajectories):
        groups.setdefault(traj.problem_id, []).append(index)
    members = list(groups.values())
    result = downsample(
        [[scores[i] for i in group] for group in members],
        keep,
        roc.mode,
        rng,
        drop_zero_signal=roc.drop_zero_signal,
        count_turns=roc.count_turns,
    )
    kept, advantages = [False] * len(trajectories), [0.0] * len(trajectories)
    samples = []
    for group, kept_positions in zip(members, result.kept):
        chosen = [group[p] for p in kept_positions]
        for index, advantage in zip(chosen, group_advantages([scores[i].reward for i in chosen])):
            kept[index], advantages[index] = True, advantage
            traj = trajectories[index]
            samples.append(
                Sample(
                    traj.prompt_ids + traj.response_ids,
                    [0] * len(traj.prompt_ids) + traj.loss_mask,
                    advantage,
                    [0.0] * len(traj.prompt_ids) + traj.behaviour_logprobs,
                )
            )
    return TrainingBatch(samples, kept, advantages, result)


def training_batch(rollouts: Rollouts, keep: int, roc: RocConfig, seed: int, stage: str, step: int) -> TrainingBatch:
    """GRPO-RoC on a step's scored rollouts, its random choices seeded by (seed, stage, step)."""
    scores = [
        trajectory_score(t, r, b) for t, r, b in zip(rollouts.trajectories, rollouts.rewards, rollouts.answer_blocks)
    ]
    return select_training_batch(rollouts.trajectories, scores, keep, roc, random.Random(f"{seed}/{stage}/{step}/roc"))


def keep_unsolved(attempts: Rollouts, k: int) -> tuple[list[Problem], dict[int, int]]:
    """The difficulty filter: the problems the policy did not solve in all k of its (scored)
    attempts, and how many problems it solved j of k times, for j = 0..k."""
    solved = solved_attempts([t.problem_id for t in attempts.trajectories], attempts.rewards)
    hard = [p for p in attempts.problems if solved.get(p.problem_id, 0) < k]
    histogram = Counter(solved.get(p.problem_id, 0) for p in attempts.problems)
    return hard, {j: histogram.get(j, 0) for j in range(k + 1)}


def step_metrics(rollouts: Rollouts, batch: TrainingBatch, update: dict, trained_version: int) -> dict[str, float]:
    """Everything an RL step reports: the rollouts' rewards and tool use, RoC's selection, the
    time each part took, how stale the rollouts were, and the update's own metrics."""
    times = rollouts.times
    metrics = rollout_metrics(rollouts.trajectories, rollouts.rewards)
    metrics.update(batch.roc.metrics(prefix="roc/"))
    lag_mean, lag_max = staleness([t.policy_version for t in rollouts.trajectories], trained_version)
    metrics.update(
        {
            "staleness/mean": lag_mean,
            "staleness/max": lag_max,
            "staleness/dropped": times.stale_dropped,
            "rollouts_reused": times.reused,
        }
    )
    metrics.update(
        {
            "kept": sum(batch.kept),
            "dropped": len(batch.kept) - sum(batch.kept),
            "time_rollout_s": times.total_s,
            "time_tool_wait_s": times.tool_wait_s,
            "time_tool_exec_s": times.tool_exec_s,
            "engine_idle_fraction": times.engine_idle_fraction,
            "engine_preemptions": times.preemptions,
            "kv_reserve_tokens": times.kv_reserve_tokens,
            "requeued_rollouts": times.requeued_rollouts,
            "engine_deaths": times.engine_deaths,
            "sandbox_retries": times.sandbox_retries,
        }
    )
    metrics.update(update)
    return metrics
