"""Prefect tasks that let a rerun of a run (same run id, or a retried flow run) skip what an
earlier attempt finished (library: tasks/store/run_folder.py). RL steps need no record: a step is done
when its row of the steps table exists, and the trainer resumes from that step's checkpoint."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from prefect import task
from prefect.cache_policies import NO_CACHE

from tasks.config import RunConfig, StageConfig
from tasks.records import RunContext
from tasks.store import run_folder


@task(cache_policy=NO_CACHE)
def finished(ctx: RunContext, name: str) -> Any:
    """The recorded result of stage `name`, or None when it has not finished."""
    result = run_folder.finished_result(ctx, name)
    if result is not None:
        print(f"{name}: finished in an earlier attempt of run {ctx.run_id}; skipping it")
    return result


@task(cache_policy=NO_CACHE)
def mark_finished(ctx: RunContext, name: str, result: Any) -> Any:
    return run_folder.record_finished(ctx, name, result)


@task(cache_policy=NO_CACHE)
def stages_to_run(cfg: RunConfig, ctx: RunContext, names: list[str] | None) -> list[StageConfig]:
    done = {s.name for s in cfg.rl.stages if run_folder.finished_result(ctx, f"rl-{s.name}") is not None}
    return cfg.rl.stages_to_run(names, done)


@task(cache_policy=NO_CACHE)
def saved_policy(ctx: RunContext, name: str) -> Path:
    return run_folder.saved_policy(ctx, name)
