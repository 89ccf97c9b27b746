"""Run a stage of a pipeline run once. A rerun of the run (same run id, or a retried flow run)
gets the result an earlier attempt recorded instead of doing the work again."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from tasks.records import RunContext
from tasks.report import end_run, start_stage_run
from tasks.resume import finished, mark_finished


def run_once(
    ctx: RunContext, name: str, work: Callable[[str], Any], mlflow_stage: str | None = None, params: dict | None = None
) -> Any:
    """The recorded result of stage `name`, or `work(mlflow_run_id)`'s, recorded. With
    `mlflow_stage` the work gets a nested MLflow run of its own (that name, `params`), ended when
    the work is done; without, it logs to the pipeline run's."""
    if (done := finished(ctx, name)) is not None:
        return done
    if mlflow_stage is None:
        return mark_finished(ctx, name, work(ctx.mlflow_run_id))
    stage_run = start_stage_run(ctx, mlflow_stage, params or {})
    result = work(stage_run)
    end_run(ctx, stage_run)
    return mark_finished(ctx, name, result)
