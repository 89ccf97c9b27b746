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
