"""Prefect tasks for the run record: MLflow runs, evaluation summaries, the final report card."""

from __future__ import annotations

import json
import subprocess
import time
import uuid
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
from pydantic import ValidationError
from rich.console import Console
from rich.table import Table

from tasks.config import RunConfig
from tasks.rollout.metrics import rollout_metrics
from tasks.rollouts import Rollouts
from tasks.runtime import RunContext
from tasks.store.tables import (
    EVALUATIONS,
    evaluation_rows,
    partition,
    stage_steps,
    write_json,
    write_table,
    write_text,
)
from tasks.tracking.mlflow_log import Tracker

SUMMARY_COLUMNS = ["stage", "steps", "pass@1 before", "pass@1 after", "tool-call rate", "tool-error rate", "wall s"]


def _git_commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                              cwd=Path(__file__).parent, timeout=5).stdout.strip() or "unknown"
    except OSError:
        return "unknown"


def _run_tags(cfg: RunConfig, run_id: str) -> dict:
    # Every MLflow run of a pipeline run carries these; they filter and group runs in the UI
    # (e.g. tags.`rstar2.roc_mode` = 'off').
    return {"rstar2.run_id": run_id, "rstar2.config": cfg.name, "rstar2.roc_mode": cfg.rl.roc.mode,
            "rstar2.scheduler": cfg.engine.scheduler}


@task(cache_policy=NO_CACHE)
def start_pipeline_run(cfg: RunConfig, config_path: str, run_id: str | None) -> RunContext:
    run_id = run_id or f"{cfg.name}-{time.strftime('%Y%m%d-%H%M%S')}-{uuid.uuid4().hex[:6]}"
    run_dir = cfg.run_dir(run_id)
    config_json = cfg.model_dump_json(indent=2)
    tracker = Tracker(cfg.output_dir)
    tags = _run_tags(cfg, run_id)
    if (run_dir / "config.json").exists():
        # The same run id again (or a retried flow run): continue it, with the same config only.
        if (run_dir / "config.json").read_text() != config_json:
            raise ValueError(f"run {run_id} exists in {run_dir} with another config: resume it with the same config "
                             "and overrides, or choose a new run id")
        mlflow_run_id = tracker.find_run({"rstar2.run_id": run_id})
        if mlflow_run_id is not None:
            tracker.reopen(mlflow_run_id)
            print(f"run {run_id}: resuming in {run_dir}, MLflow run {mlflow_run_id} ({tracker.uri})")
            return RunContext(run_id, run_dir, mlflow_run_id, Path(cfg.output_dir), tags)
    run_dir.mkdir(parents=True, exist_ok=True)
    write_text(config_json, run_dir / "config.json")
    params = {"config_path": config_path, "git_commit": _git_commit(), "run_dir": str(run_dir)}
    params.update(_flatten(cfg.model_dump(mode="json")))
    mlflow_run_id = tracker.start_run(run_id, params, tags=tags)
    tracker.log_artifact(mlflow_run_id, run_dir / "config.json")
    print(f"run {run_id}: outputs in {run_dir}, MLflow run {mlflow_run_id} ({tracker.uri})")
    return RunContext(run_id, run_dir, mlflow_run_id, Path(cfg.output_dir), tags)


@task(cache_policy=NO_CACHE)
def reopen_run(output_dir: str, run_id: str, eval_overrides: dict | None) -> tuple[RunConfig, RunContext]:
    """An existing run's recorded config (with `eval_overrides` applied to its eval section, the
    only part a later evaluation may change) and context, its MLflow run reopened."""
    run_dir = Path(output_dir) / "runs" / run_id
    if not (run_dir / "config.json").exists():
        runs = sorted(p.parent.name for p in (Path(output_dir) / "runs").glob("*/config.json"))
        raise ValueError(f"no run {run_id!r} under {Path(output_dir) / 'runs'} (runs there: {runs})")
    recorded = RunConfig.model_validate_json((run_dir / "config.json").read_text())
    try:
        cfg = recorded.model_copy(update={"eval": recorded.eval.model_validate(
            {**recorded.eval.model_dump(), **(eval_overrides or {})})})
    except ValidationError as exc:
        raise ValueError(f"invalid eval_overrides {eval_overrides}:\n{exc}") from exc
    tracker = Tracker(cfg.output_dir)
    mlflow_run_id = tracker.find_run({"rstar2.run_id": run_id})
    if mlflow_run_id is None:
        raise ValueError(f"run {run_id} has no MLflow run in {tracker.uri}")
    tracker.reopen(mlflow_run_id)
    tags = _run_tags(cfg, run_id)
    return cfg, RunContext(run_id, run_dir, mlflow_run_id, Path(cfg.output_dir), tags)


def _flatten(tree: dict, prefix: str = "") -> dict:
    flat = {}
    for key, value in tree.items():
        if isinstance(value, dict):
            flat.update(_flatten(value, f"{prefix}{key}."))
        else:
            flat[f"{prefix}{key}"] = json.dumps(value) if isinstance(value, list) else value
    return flat


@task(cache_policy=NO_CACHE)
def start_stage_run(ctx: RunContext, stage: str, params: dict) -> str:
    """The stage's nested MLflow run: the one an interrupted attempt started, or a new one."""
    tracker = ctx.tracker
    existing = tracker.find_run({"rstar2.run_id": ctx.run_id, "rstar2.stage": stage}, ctx.mlflow_run_id)
    if existing is not None:
        tracker.reopen(existing)
        return existing
    return tracker.start_run(stage, params, parent_run_id=ctx.mlflow_run_id,
                             tags={"rstar2.run_id": ctx.run_id, **ctx.tags, "rstar2.stage": stage})


@task(cache_policy=NO_CACHE)
def track_progress(artifact_id: UUID | None, stage: str, done: int, total: int) -> UUID:
    """A Prefect progress artifact for the stage (percent of its steps done), created at 0."""
    percent = 100.0 * done / max(total, 1)
    if artifact_id is None:
        key = "rl-progress-" + "".join(c if c.isalnum() else "-" for c in stage.lower())
        return create_progress_artifact(percent, key=key, description=f"RL stage {stage}: steps done")
    return update_progress_artifact(artifact_id, percent, description=f"RL stage {stage}: {done} of {total} steps")


@task(cache_policy=NO_CACHE)
def publish_stage_summary(ctx: RunContext, stage: str) -> None:
    """The stage's steps (from the steps table, so a resumed stage shows all of them) as a Prefect
    table artifact: reward, kept, tool use, length, timing."""
    columns = ("reward_mean", "kept", "tool_call_rate", "tool_error_rate", "response_length_mean",
               "engine_idle_fraction", "time_rollout_s", "time_update_s")
    rows = [{"step": step, **{c: round(float(m[c]), 4) for c in columns if c in m}}
            for step, m in stage_steps(ctx.run_dir, stage).items()]
    key = "stage-summary-" + "".join(c if c.isalnum() else "-" for c in stage.lower())
    create_table_artifact(rows, key=key, description=f"RL stage {stage}, one row per step")


@task(cache_policy=NO_CACHE)
def end_run(ctx: RunContext, mlflow_run_id: str, ok: bool = True) -> None:
    ctx.tracker.end_run(mlflow_run_id, ok)


@task(cache_policy=NO_CACHE)
def summarize_eval(ctx: RunContext, label: str, benchmark: str, rollouts: Rollouts, k: int) -> dict:
    """avg@k pass@1 and tool use of checkpoint `label` on one benchmark: logged on the parent
    run (eval/<label>/... for the held-out split, eval/<label>/<benchmark>/... otherwise) and
    written as the (label, benchmark) part of the evaluations table."""
    metrics = rollout_metrics(rollouts.trajectories, rollouts.rewards)
    metrics["pass_at_1"] = metrics["reward_mean"]  # mean over problems and their k samples
    prefix = f"eval/{label}" if benchmark == "heldout" else f"eval/{label}/{benchmark}"
    ctx.tracker.log_metrics(ctx.mlflow_run_id, {f"{prefix}/{key}": v for key, v in metrics.items()})
    row = {"run_id": ctx.run_id, "checkpoint": label, "benchmark": benchmark, "problems": len(rollouts.problems),
           "k": k, **{c: metrics[c] for c in EVALUATIONS.names if c in metrics}}
    part = partition(ctx.run_dir, "evaluations", checkpoint=label, benchmark=benchmark)
    table = write_table([row], EVALUATIONS, part)
    # A few whole trajectories to read next to the numbers in the MLflow UI: the first sample of
    # up to 8 problems.
    samples = [{"problem_id": t.problem_id, "reward": r, "stop_reason": t.stop_reason, "response": t.response}
               for t, r in zip(rollouts.trajectories, rollouts.rewards) if t.sample == 0][:8]
    sample_path = write_json(samples, table.with_name("samples.json"))
    for path in (table, sample_path):
        ctx.tracker.log_artifact(ctx.mlflow_run_id, path, f"evaluations/{label}/{benchmark}")
    print(f"[eval {label} / {benchmark}] pass@1 (avg@{k}) {metrics['pass_at_1']:.3f}, tool-call rate "
          f"{metrics['tool_call_rate']:.2f}, tool-error rate {metrics['tool_error_rate']:.2f}")
    return metrics


def evaluation_markdown(run_dir: Path) -> str:
    """pass@1 of every evaluated checkpoint (rows, in evaluation order) on every benchmark."""
    rows = evaluation_rows(run_dir)
    checkpoints = list(dict.fromkeys(r["checkpoint"] for r in rows))
    benchmarks = list(dict.fromkeys(r["benchmark"] for r in rows))
    value = {(r["checkpoint"], r["benchmark"]): r["pass_at_1"] for r in rows}
    lines = ["| checkpoint | " + " | ".join(f"{b} pass@1" for b in benchmarks) + " |",
             "|---|" + "---|" * len(benchmarks)]
    for checkpoint in checkpoints:
        cells = [f"{value[(checkpoint, b)]:.3f}" if (checkpoint, b) in value else "" for b in benchmarks]
        lines.append(f"| {checkpoint} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


@task(cache_policy=NO_CACHE)
def publish_summary(ctx: RunContext, rows: list[dict], wall_s: float) -> str:
    """The report card: printed, saved under the run, logged to MLflow, a Prefect artifact."""
    def cell(value) -> str:
        return f"{value:.3f}" if isinstance(value, float) else ("" if value is None else str(value))

    shown = [{**row, "wall s": f"{row['wall s']:.0f}"} for row in rows]

    table = Table(title=f"rstar2-pipeline run {ctx.run_id} ({wall_s:.0f} s)")
    for column in SUMMARY_COLUMNS:
        table.add_column(column, justify="left" if column == "stage" else "right")
    for row in shown:
        table.add_row(*(cell(row.get(column)) for column in SUMMARY_COLUMNS))
    Console(width=120).print(table)
    markdown = "| " + " | ".join(SUMMARY_COLUMNS) + " |\n|" + "---|" * len(SUMMARY_COLUMNS) + "\n"
    markdown += "".join("| " + " | ".join(cell(r.get(c)) for c in SUMMARY_COLUMNS) + " |\n" for r in shown)
    evaluations = evaluation_markdown(ctx.run_dir)
    print(evaluations)
    markdown = (f"# Run {ctx.run_id}\n\nwall time {wall_s:.0f} s, outputs in `{ctx.run_dir}`\n\n{markdown}"
                f"\n## Evaluations (avg@k pass@1)\n\n{evaluations}")
    path = write_text(markdown, ctx.run_dir / "summary.md")
    write_json({"wall_s": wall_s, "stages": rows}, ctx.run_dir / "summary.json")
    tracker = ctx.tracker
    tracker.log_artifact(ctx.mlflow_run_id, path)
    tracker.log_metrics(ctx.mlflow_run_id, {"wall_s": wall_s})
    create_markdown_artifact(key="run-summary", markdown=markdown, description=f"run {ctx.run_id}")
    return markdown


class Stopwatch:
    """Wall time per stage for the summary table, summed over the attempts of a run (kept in
    run_dir/state/wall.json): a resumed run's table shows what each stage cost, not the seconds
    its second attempt spent skipping it. A stage's time counts from the end of the one before."""

    def __init__(self, run_dir: Path):
        self.path = run_dir / "state" / "wall.json"
        self.spent: dict[str, float] = json.loads(self.path.read_text()) if self.path.exists() else {}
        self.last = time.perf_counter()

    def lap(self, stage: str) -> float:
        """The stage's seconds over all attempts, this one's up to now included."""
        now = time.perf_counter()
        self.spent[stage] = self.spent.get(stage, 0.0) + now - self.last
        self.last = now
        write_json(self.spent, self.path)
        return self.spent[stage]

    def total(self) -> float:
        return sum(self.spent.values())


def stage_row(stage: str, steps: int | None, before: dict | None, after: dict | None, clock: Stopwatch) -> dict:
    wall_s = clock.lap(stage)
    return {
        "stage": stage, "steps": steps,
        "pass@1 before": before["pass_at_1"] if before else None,
        "pass@1 after": after["pass_at_1"] if after else None,
        "tool-call rate": after["tool_call_rate"] if after else None,
        "tool-error rate": after["tool_error_rate"] if after else None,
        "wall s": round(wall_s, 1),
    }
