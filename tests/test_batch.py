"""From trajectories to the training batch: RoC scores come from the sandbox's structured
statuses, kept trajectories become samples whose loss mask covers only generated tokens, and
advantages are computed over the kept G of each problem.

Run: .venv/bin/python -m pytest tests/test_batch.py -q
"""

import random

import pytest

from tasks.config import RocConfig
from tasks.records import ToolCallRecord, ToolStatus, Trajectory
from tasks.rl.batch import select_training_batch, trajectory_score
from tasks.rl.roc import p_err


def _trajectory(problem: str, sample: int, statuses: list[ToolStatus], turns: int) -> Trajectory:
    traj = Trajectory(problem, sample, prompt_ids=[1, 2, 3])
    traj.extend([10, 11], "x", trainable=True, logprobs=[-0.5, -1.0])
    traj.extend([12], "tool", trainable=False)
    traj.extend([13], "y", trainable=True, logprobs=[-0.25])
    traj.turns = turns
    traj.tool_calls = [ToolCallRecord(turn + 1, status, 0.1, "print(1)") for turn, status in enumerate(statuses)]
    return traj


def test_failures_come_from_statuses_and_sandbox_outages_do_not_count():
    statuses = [
        ToolStatus.OK,
        ToolStatus.PARSE_ERROR,
        ToolStatus.TIMEOUT,
        ToolStatus.MEMORY,
        ToolStatus.OUTPUT_LIMIT,
        ToolStatus.ERROR,
        ToolStatus.INTERNAL,
        ToolStatus.OK,
    ]
    score = trajectory_score(_trajectory("p", 0, statuses, turns=9), reward=1.0, answer_blocks=1)
    assert (score.tool_calls, score.tool_failures) == (8, 5)
    assert p_err(score) == 5 / 8
    assert score.turns_after_first_tool_response == 8
    no_tool = trajectory_score(_trajectory("p", 1, [], turns=1), reward=1.0, answer_blocks=1)
    assert p_err(no_tool) == 0.5 and no_tool.turns_after_first_tool_response == 0


def test_selection_keeps_g_per_problem_with_signal_and_masks_tool_tokens():
    trajectories, scores = [], []
    for problem, rewards in (("mixed", [1, 0, 1, 0, 0, 1, 0, 0]), ("solved", [1] * 8)):
        for sample, reward in enumerate(rewards):
            traj = _trajectory(problem, sample, [ToolStatus.OK], turns=2)
            trajectories.append(traj)
            scores.append(trajectory_score(traj, float(reward), answer_blocks=1))
    batch = select_training_batch(trajectories, scores, keep=4, roc=RocConfig(mode="paper"), rng=random.Random(0))
    assert sum(batch.kept[:8]) == 4 and not any(batch.kept[8:])  # the all-correct group has no signal
    assert batch.roc.dropped_zero_signal == 1 and len(batch.samples) == 4
    kept_rewards = [scores[i].reward for i in range(8) if batch.kept[i]]
    # float64: r - mean is exact (quarters); a rounding per division and per add: ~1e-15
    assert 0 < sum(kept_rewards) < 4 and abs(sum(a for a, k in zip(batch.advantages, batch.kept) if k)) < 1e-6
    for sample in batch.samples:
        assert sample.token_ids == [1, 2, 3, 10, 11, 12, 13] and sample.loss_mask == [0, 0, 0, 1, 1, 0, 1]


def test_solved_attempts_counts_rewarded_attempts_per_problem():
    from tasks.rollout.metrics import solved_attempts

    assert solved_attempts(["a", "a", "b", "a", "b"], [1.0, 0.0, 0.0, 1.0, 0.0]) == {"a": 2, "b": 0}


def test_a_generated_turn_without_its_log_probs_is_refused_and_a_cut_keeps_them_aligned():
    traj = _trajectory("p", 0, [], turns=1)
    for logprobs, given in ((None, "no log-probs"), ([-0.5], "1 log-probs")):
        with pytest.raises(ValueError, match=f"trajectory p sample 0, turn 1: the engine returned {given} for 2"):
            traj.extend([14, 15], "z", trainable=True, logprobs=logprobs)
    assert traj.response_ids == [10, 11, 12, 13]  # nothing half-appended
    assert traj.behaviour_logprobs == [-0.5, -1.0, 0.0, -0.25]  # 0.0 only under the tool token's mask
    traj.truncate(3)
    assert (traj.response_ids, traj.loss_mask, traj.behaviour_logprobs) == ([10, 11, 12], [1, 1, 0], [-0.5, -1.0, 0.0])
