"""Prefect tasks for the run record: MLflow runs, evaluation summaries, the report card
(library: tasks/tracking/mlflow_log.py, tasks/summary/run_card.py)."""

from __future__ import annotations

from pathlib import Path
from uuid import UUID

from prefect import task
from prefect.artifacts import (
    create_markdown_artifact,
    create_progress_artifact,
    create_table_artifact,
    update_progress_artifact,
)
from prefect.cache_policies import NO_CACHE

from tasks.config import RunConfig
from tasks.records import Rollouts, RunContext
from tasks.store import run_folder
from tasks.store.tables import EVALUATIONS, partition, stage_steps, write_json, write_table, write_text
from tasks.summary import run_card
from tasks.tracking import mlflow_log
from tasks.tracking.mlflow_log import Tracker


@task(cache_policy=NO_CACHE)
def start_pipeline_run(cfg: RunConfig, config_path: str, run_id: str | None) -> RunContext:
    """A new run, or run `run_id` continued: the run folder decides, MLflow records."""
    run_id, run_dir = run_folder.open_run(cfg, run_id)
    mlflow_run_id = mlflow_log.pipeline_run(cfg, config_path, run_id, run_dir)
    return RunContext(run_id, run_dir, mlflow_run_id, Path(cfg.output_dir), mlflow_log.run_tags(cfg, run_id))


@task(cache_policy=NO_CACHE)
def reopen_run(output_dir: str, run_id: str, eval_overrides: dict | None) -> tuple[RunConfig, RunContext]:
    cfg, run_dir = run_folder.reopen_run(output_dir, run_id, eval_overrides)
    mlflow_run_id = mlflow_log.reopened_run(output_dir, run_id)
    return cfg, RunContext(run_id, run_dir, mlflow_run_id, Path(cfg.output_dir), mlflow_log.run_tags(cfg, run_id))


@task(cache_policy=NO_CACHE)
def start_stage_run(ctx: RunContext, stage: str, params: dict) -> str:
    return mlflow_log.start_stage_run(ctx, stage, params)


@task(cache_policy=NO_CACHE)
def end_run(ctx: RunContext, mlflow_run_id: str, ok: bool = True) -> None:
    Tracker(ctx.output_dir).end_run(mlflow_run_id, ok)


@task(cache_policy=NO_CACHE)
def track_progress(artifact_id: UUID | None, stage: str, done: int, total: int) -> UUID:
    """A Prefect progress artifact for the stage (percent of its steps done), created at 0."""
    percent = 100.0 * done / max(total, 1)
    if artifact_id is None:
        return create_progress_artifact(
            percent, key=run_card.artifact_key("rl-progress", stage), description=f"RL stage {stage}: steps done"
        )
    return update_progress_artifact(artifact_id, percent, description=f"RL stage {stage}: {done} of {total} steps")


@task(cache_policy=NO_CACHE)
def publish_stage_summary(ctx: RunContext, stage: str) -> None:
    """The stage's steps (from the steps table, so a resumed stage shows all of them) as a Prefect
    table artifact: reward, kept, tool use, length, timing."""
    rows = run_card.stage_summary_rows(stage_steps(ctx.run_dir, stage))
    key = run_card.artifact_key("stage-summary", stage)
    create_table_artifact(rows, key=key, description=f"RL stage {stage}, one row per step")


@task(cache_policy=NO_CACHE)
def summarize_eval(ctx: RunContext, label: str, benchmark: str, rollouts: Rollouts, k: int) -> dict:
    """avg@k pass@1 and tool use of checkpoint `label` on one benchmark: logged on the parent
    run (eval/<label>/... for the held-out split, eval/<label>/<benchmark>/... otherwise) and
    written as the (label, benchmark) part of the evaluations table, with sample trajectories."""
    metrics, row, samples = run_card.evaluation(ctx.run_id, label, benchmark, rollouts, k)
    prefix = f"eval/{label}" if benchmark == "heldout" else f"eval/{label}/{benchmark}"
    tracker = Tracker(ctx.output_dir)
    tracker.log_metrics(ctx.mlflow_run_id, {f"{prefix}/{key}": v for key, v in metrics.items()})
    table = write_table(
        [row], EVALUATIONS, partition(ctx.run_dir, "evaluations", checkpoint=label, benchmark=benchmark)
    )
    for path in (table, write_json(samples, table.with_name("samples.json"))):
        tracker.log_artifact(ctx.mlflow_run_id, path, f"evaluations/{label}/{benchmark}")
    print(
        f"[eval {label} / {benchmark}] pass@1 (avg@{k}) {metrics['pass_at_1']:.3f}, tool-call rate "
        f"{metrics['tool_call_rate']:.2f}, tool-error rate {metrics['tool_error_rate']:.2f}"
    )
    return metrics


@task(cache_policy=NO_CACHE)
def start_stopwatch(ctx: RunContext) -> run_card.Stopwatch:
    return run_card.Stopwatch(ctx.run_dir)


@task(cache_policy=NO_CACHE)
def stage_row(
    stage: str, steps: int | None, before: dict | None, after: dict | None, clock: run_card.Stopwatch
) -> dict:
    """The stage's row of the report card; its wall time counts from the end of the stage before."""
    return run_card.stage_row(stage, steps, before, after, clock)


@task(cache_policy=NO_CACHE)
def publish_summary(ctx: RunContext, rows: list[dict], wall_s: float) -> Path:
    """The report card: printed, saved under the run, logged to MLflow, a Prefect artifact."""
    markdown = run_card.report_card(ctx.run_id, ctx.run_dir, rows, wall_s)
    path = write_text(markdown, ctx.run_dir / "summary.md")
    write_json({"wall_s": wall_s, "stages": rows}, ctx.run_dir / "summary.json")
    tracker = Tracker(ctx.output_dir)
    tracker.log_artifact(ctx.mlflow_run_id, path)
    tracker.log_metrics(ctx.mlflow_run_id, {"wall_s": wall_s})
    create_markdown_artifact(key="run-summary", markdown=markdown, description=f"run {ctx.run_id}")
    return path


@task(cache_policy=NO_CACHE)
def record_placement(ctx: RunContext, placement: list[dict]) -> Path:
    """Where each actor of the run's runtime was placed (role, node, pid, GPUs): to the run folder
    (placement.json) and the run's MLflow run, as printed when the runtime started."""
    path = write_json({"actors": placement}, ctx.run_dir / "placement.json")
    Tracker(ctx.output_dir).log_artifact(ctx.mlflow_run_id, path)
    return path
