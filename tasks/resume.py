"""What a run has finished, so that running it again with the same run id (or retrying the
failed flow run) skips it: one JSON record per finished stage under run_dir/state/, written
atomically when the stage ends. RL steps need no record: a step is done when its row of the steps
table exists, and the trainer resumes from that step's checkpoint (tasks/rl_update.py)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from prefect import task
from prefect.cache_policies import NO_CACHE

from tasks.config import RunConfig, StageConfig
from tasks.runtime import RunContext
from tasks.store.tables import write_json


def _path(ctx: RunContext, name: str) -> Path:
    return ctx.run_dir / "state" / f"{name}.json"


@task(cache_policy=NO_CACHE)
def finished(ctx: RunContext, name: str) -> Any:
    """The recorded result of stage `name`, or None when it has not finished."""
    path = _path(ctx, name)
    if not path.exists():
        return None
    print(f"{name}: finished in an earlier attempt of run {ctx.run_id}; skipping it")
    return json.loads(path.read_text())["result"]


@task(cache_policy=NO_CACHE)
def mark_finished(ctx: RunContext, name: str, result: Any) -> Any:
    """Record stage `name` as finished with its (JSON-able) result, and return the result."""
    path = write_json({"result": result}, _path(ctx, name))
    return json.loads(path.read_text())["result"]


@task(cache_policy=NO_CACHE)
def stages_to_run(cfg: RunConfig, ctx: RunContext, names: list[str] | None) -> list[StageConfig]:
    """The RL stages a run should (re)run: `names` (every stage when None), in config order. A stage
    starts from the policy its predecessor left, so every earlier stage not listed must have
    finished in this run."""
    known = [s.name for s in cfg.rl.stages]
    if names is None:
        return list(cfg.rl.stages)
    if unknown := [n for n in names if n not in known]:
        raise ValueError(f"stages {unknown} are not in the config's rl.stages {known}")
    first = min(known.index(n) for n in names) if names else len(known)
    if missing := [n for n in known[:first] if not _path(ctx, f"rl-{n}").exists()]:
        raise ValueError(f"run {ctx.run_id} has not finished stages {missing}, which come before {names}: "
                         f"run them first (stages={missing + list(names)})")
    return [s for s in cfg.rl.stages if s.name in names]


@task(cache_policy=NO_CACHE)
def saved_policy(ctx: RunContext, name: str) -> Path:
    """The Hugging Face directory of a run's policy `name` (base, sft, or a finished RL stage)."""
    path = ctx.run_dir / "models" / name
    if not (path / "config.json").exists():
        saved = sorted(p.parent.name for p in (ctx.run_dir / "models").glob("*/config.json"))
        raise ValueError(f"run {ctx.run_id} has no saved policy {name!r} (saved: {saved})")
    return path
