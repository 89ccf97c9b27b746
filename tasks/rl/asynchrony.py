"""Asynchronous RL as pure rules over plain numbers: which steps the engines may roll out while an
update runs, which finished rollouts are fresh enough to train on, and what a step reports about
it (staleness, idle time).

A policy version counts a stage's updates: step t's rollouts are drawn by version t when
generation waits for the update (rl.async off). With `one_step` the engines draw step t+1 on
version t while step t's update runs, so its rollouts lag one version; `bounded` goes on into
later steps while the update still runs, up to `max_staleness` versions (recipe.md, scaleout.md).
"""

from __future__ import annotations

from collections.abc import Sequence

from tasks.config import AsyncConfig
from tasks.records import Trajectory


def steps_ahead(overlap: AsyncConfig, step: int, steps: int) -> tuple[list[int], list[int]]:
    """While step `step`'s update runs (version `step` in the engines): the steps whose rollouts
    are drawn whatever the update's time (`must`), and those drawn only while it still runs
    (`may`). Nothing crosses the stage's last step: the next stage starts from its final policy."""
    last = steps - 1
    if overlap.mode == "off" or step >= last:
        return [], []
    if overlap.mode == "one_step":
        return [step + 1], []
    return [step + 1], list(range(step + 2, min(last, step + overlap.staleness_limit) + 1))


def fresh(
    finished: dict[int, Trajectory], trained_version: int, limit: int, group_size: int, drawing_version: int
) -> tuple[dict[int, Trajectory], list[int]]:
    """The finished rollouts a step trained at `trained_version` may use, kept or dropped by whole
    groups (a problem's rollouts, batch indices `i // group_size`), and the indices dropped (which
    no later draw can use either). A group is kept when all its finished rollouts were drawn by
    one version, at most `limit` versions earlier (and not later, which a resume from an older
    checkpoint leaves), and the group is whole or its rest is drawn now by that same version
    (`drawing_version`): its baseline and RoC's choice are then taken within one policy."""
    groups: dict[int, dict[int, Trajectory]] = {}
    for index, trajectory in finished.items():
        groups.setdefault(index // group_size, {})[index] = trajectory
    kept: dict[int, Trajectory] = {}
    for members in groups.values():
        versions = {t.policy_version for t in members.values()}
        version = min(versions)
        if len(versions) > 1 or not 0 <= trained_version - version <= limit:
            continue
        if len(members) == group_size or version == drawing_version:
            kept |= members
    return kept, sorted(set(finished) - set(kept))


def staleness(versions: Sequence[int], trained_version: int) -> tuple[float, int]:
    """Mean and most versions the trained rollouts lag behind the update."""
    lags = [trained_version - v for v in versions]
    return (sum(lags) / len(lags), max(lags)) if lags else (0.0, 0)


def idle_fraction(busy_s: float, wall_s: float, workers: int = 1) -> float:
    """The share of `workers` x `wall_s` not spent busy."""
    if wall_s <= 0 or workers <= 0:
        return 0.0
    return min(1.0, max(0.0, 1.0 - busy_s / (wall_s * workers)))


def step_time(mode: str, rollout_s: float, update_s: float, sync_s: float) -> float:
    """A step's steady-state wall time from its parts. Off: rollouts, then the update, then the
    weight push. one_step and bounded: the engines draw the next step's rollouts while the
    update runs, so the longer of the two paces the step; the push stalls both."""
    if mode == "off":
        return rollout_s + update_s + sync_s
    return max(rollout_s, update_s) + sync_s
