"""Summary numbers over a batch of scored trajectories (pure)."""

from __future__ import annotations

from collections import Counter

from tasks.records import ToolStatus, Trajectory


def max_logprob_gap(a: list[list[float]], b: list[list[float]]) -> float:
    """Largest per-token |log p_a - log p_b| over paired sequences (0 for none)."""
    return max((abs(x - y) for row_a, row_b in zip(a, b) for x, y in zip(row_a, row_b)), default=0.0)


def rollout_metrics(trajectories: list[Trajectory], rewards: list[float]) -> dict[str, float]:
    n = max(len(trajectories), 1)
    calls = [c for t in trajectories for c in t.tool_calls]
    stops = Counter(t.stop_reason for t in trajectories)
    metrics = {
        "reward_mean": sum(rewards) / n,
        "trajectories": len(trajectories),
        "tool_calls": len(calls),
        "tool_errors": sum(c.status.is_failure for c in calls),
        "tool_internal": sum(c.status is ToolStatus.INTERNAL for c in calls),  # outages, not the model's
        "tool_call_rate": sum(bool(t.tool_calls) for t in trajectories) / n,
        "tool_error_rate": sum(c.status.is_failure for c in calls) / max(len(calls), 1),
        "response_length_mean": sum(len(t.response_ids) for t in trajectories) / n,
        "turns_mean": sum(t.turns for t in trajectories) / n,
    }
    metrics.update({f"stop_{reason}": count / n for reason, count in stops.items()})
    return metrics


def solved_attempts(problem_ids: list[str], rewards: list[float]) -> dict[str, int]:
    """Per problem, how many of its attempts earned the reward (what the difficulty and consensus
    filters count)."""
    solved: dict[str, int] = {}
    for problem_id, reward in zip(problem_ids, rewards):
        solved[problem_id] = solved.get(problem_id, 0) + int(reward > 0)
    return solved
