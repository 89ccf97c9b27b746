"""Rollouts kept as they finish, for steps whose rollouts part is not written yet.

One JSON file per finished trajectory, `<run>/inflight/<stage>/step=<n>/<index>.json`, the index
being its place in the step's batch (problem position x samples + sample), each written
atomically. A step rolled out ahead of its update (rl.async) finds its rollouts here, and a run
killed at any point resumes with every finished trajectory of its unfinished steps: none is
drawn twice and none is lost. Once the step is recorded its rollouts part holds them all and the
folder goes. Rollouts kept under other settings than the step's now are not reused.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import asdict
from pathlib import Path

from tasks.records import RolloutSpec, Trajectory
from tasks.store.tables import write_text

SETTINGS = "settings.txt"  # beside the rollouts: what they were drawn under


def step_folder(run_dir: Path, stage: str, step: int) -> Path:
    return run_dir / "inflight" / stage / f"step={step}"


def keep_finished(folder: Path, index: int, trajectory: Trajectory) -> None:
    write_text(json.dumps(trajectory.to_dict()), folder / f"{index:06d}.json")


def finished(folder: Path) -> dict[int, Trajectory]:
    """index -> trajectory for every rollout of the step kept so far (none for a new step)."""
    kept = {}
    for path in sorted(folder.glob("*.json")):
        try:
            kept[int(path.stem)] = Trajectory.from_dict(json.loads(path.read_text()))
        except (ValueError, KeyError, TypeError) as exc:
            raise ValueError(f"{path}: not a finished rollout ({exc}); delete the file to draw it again") from exc
    return kept


def settings_key(spec: RolloutSpec, rollouts_per_problem: int) -> str:
    """What a kept rollout must have been drawn under to be reused: sampling, budget and tool
    settings, and the batch's layout (an index is problem position x samples + sample)."""
    return json.dumps({**asdict(spec), "rollouts_per_problem": rollouts_per_problem}, sort_keys=True)


def settle(folder: Path, settings: str) -> int:
    """Ties the step's kept rollouts to the settings that draw it now: those kept under others (a
    resume with another temperature, budget or tool) are deleted, to be drawn again, never reused;
    how many."""
    marker = folder / SETTINGS
    kept = sorted(folder.glob("*.json"))
    if kept and (not marker.exists() or marker.read_text() != settings):
        for path in kept:
            path.unlink()
    else:
        kept = []
    write_text(settings, marker)
    return len(kept)


def discard(folder: Path, indices: list[int]) -> None:
    """Delete these kept rollouts (too stale to train on): they are drawn again, and counted as
    dropped once, not at every draw that finds them."""
    for index in indices:
        (folder / f"{index:06d}.json").unlink(missing_ok=True)


def forget(folder: Path) -> None:
    shutil.rmtree(folder, ignore_errors=True)
    for parent in (folder.parent, folder.parent.parent):  # the stage's and the run's, once empty
        try:
            parent.rmdir()
        except OSError:
            break
