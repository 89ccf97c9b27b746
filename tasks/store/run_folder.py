"""A run's folder and what it records about itself: the context every task gets, where each
kind of output lies, and the finished-stage records that make a rerun skip work already done.

    <output_dir>/runs/<run_id>/
        config.json                 the validated config (a resumed run must match it)
        state/<stage>.json          a finished stage's result; wall.json: seconds per stage
        data/ models/ checkpoints/  curated splits; base, sft and RL policies; DeepSpeed steps
        rollouts/ steps/ evaluations/   Parquet tables (tasks/store/tables.py)
"""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tasks.store.tables import step_part, write_json


@dataclass
class RunContext:
    """Where a run writes, and its MLflow parent run: plain data, safe to pass to tasks."""

    run_id: str
    run_dir: Path
    mlflow_run_id: str
    output_dir: Path
    tags: dict = field(default_factory=dict)  # MLflow tags every run of this pipeline run carries

    def state_path(self, name: str) -> Path:
        return self.run_dir / "state" / f"{name}.json"

    def checkpoints(self, stage: str) -> Path:
        return self.run_dir / "checkpoints" / stage

    def policy_dir(self, name: str) -> Path:
        """The Hugging Face directory of policy `name` (base, sft or an RL stage)."""
        return self.run_dir / "models" / name


def finished_result(ctx: RunContext, name: str) -> Any:
    """The recorded result of stage `name`, or None when it has not finished."""
    path = ctx.state_path(name)
    return json.loads(path.read_text())["result"] if path.exists() else None


def record_finished(ctx: RunContext, name: str, result: Any) -> Any:
    """Record stage `name` as finished with its (JSON-able) result; returns the result as a later
    attempt will read it back."""
    path = write_json({"result": result}, ctx.state_path(name))
    return json.loads(path.read_text())["result"]


def saved_policy(ctx: RunContext, name: str) -> Path:
    """The Hugging Face directory of a run's policy `name` (base, sft, or a finished RL stage)."""
    path = ctx.policy_dir(name)
    if not (path / "config.json").exists():
        saved = sorted(p.parent.name for p in (ctx.run_dir / "models").glob("*/config.json"))
        raise ValueError(f"run {ctx.run_id} has no saved policy {name!r} (saved: {saved})")
    return path


def steps_done(ctx: RunContext, stage: str, steps: int) -> list[int]:
    """The steps of an RL stage with a row in the steps table: a step is done once it has one."""
    return [k for k in range(steps) if step_part(ctx.run_dir, "steps", stage, k).exists()]


def checkpoint_tag(step: int) -> str:
    return f"step-{step:05d}"


def prune_checkpoints(directory: Path, keep: int) -> None:
    """Remove all but the newest `keep` step checkpoints, so a long run does not fill the disk."""
    for old in sorted(directory.glob("step-*"))[:-keep]:
        shutil.rmtree(old)
