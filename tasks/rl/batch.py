"""From scored trajectories to the training batch: GRPO-RoC selection and advantages.

Pure: trajectories and rewards in, kept flags, advantages and training samples out.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from tasks.config import RocConfig
from tasks.rl.roc import RocResult, TrajectoryScore, downsample, group_advantages
from tasks.rollout.agent import Trajectory


@dataclass(frozen=True)
class Sample:
    token_ids: list[int]
    loss_mask: list[int]  # per token of token_ids: 1 where the token is a training target
    advantage: float = 0.0


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
    result = downsample([[scores[i] for i in group] for group in members], keep, roc.mode, rng,
                        drop_zero_signal=roc.drop_zero_signal, count_turns=roc.count_turns)
    kept, advantages = [False] * len(trajectories), [0.0] * len(trajectories)
    samples = []
    for group, kept_positions in zip(members, result.kept):
        chosen = [group[p] for p in kept_positions]
        for index, advantage in zip(chosen, group_advantages([scores[i].reward for i in chosen])):
            kept[index], advantages[index] = True, advantage
            traj = trajectories[index]
            samples.append(Sample(traj.prompt_ids + traj.response_ids,
                                  [0] * len(traj.prompt_ids) + traj.loss_mask, advantage))
    return TrainingBatch(samples, kept, advantages, result)


def solved_attempts(problem_ids: list[str], rewards: list[float]) -> dict[str, int]:
    """Per problem, how many of its attempts earned the reward (the difficulty filter's count)."""
    solved: dict[str, int] = {}
    for problem_id, reward in zip(problem_ids, rewards):
        solved[problem_id] = solved.get(problem_id, 0) + int(reward > 0)
    return solved
