"""Rollouts kept as they finish, for steps whose rollouts part is not written yet.

One JSON file per finished trajectory, `<run>/inflight/<stage>/step=<n>/<index>.json`, the index
being its place in the step's batch (problem position x samples + sample), each written
atomically. A step rolled out ahead of its update (rl.async) finds its rollouts here, and a run
killed at any point resumes with every finished trajectory of its unfinished steps: none is
drawn twice and none is lost. Once the step is recorded its rollouts part holds them all and the
folder goes.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from tasks.records import Trajectory
from tasks.store.tables import write_text


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
