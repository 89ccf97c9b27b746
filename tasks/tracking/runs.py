"""A pipeline run's records in MLflow and its folder: start one, continue one (same run id, or a
retried flow run), reopen a finished one for a later evaluation, and the nested run of a stage."""

from __future__ import annotations

import json
import subprocess
import time
import uuid
from pathlib import Path

from pydantic import ValidationError

from tasks.config import RunConfig
from tasks.store.run import RunContext
from tasks.store.tables import write_text
from tasks.tracking.mlflow_log import Tracker


def _git_commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                              cwd=Path(__file__).parent, timeout=5).stdout.strip() or "unknown"
    except OSError:
        return "unknown"


def run_tags(cfg: RunConfig, run_id: str) -> dict:
    # Every MLflow run of a pipeline run carries these; they filter and group runs in the UI
    # (e.g. tags.`rstar2.roc_mode` = 'off').
    return {"rstar2.run_id": run_id, "rstar2.config": cfg.name, "rstar2.roc_mode": cfg.rl.roc.mode,
            "rstar2.scheduler": cfg.engine.scheduler}


def flatten(tree: dict, prefix: str = "") -> dict:
    """Nested config values as MLflow params with dotted keys (lists as JSON)."""
    flat = {}
    for key, value in tree.items():
        if isinstance(value, dict):
            flat.update(flatten(value, f"{prefix}{key}."))
        else:
            flat[f"{prefix}{key}"] = json.dumps(value) if isinstance(value, list) else value
    return flat


def start_pipeline_run(cfg: RunConfig, config_path: str, run_id: str | None) -> RunContext:
    """A new run (folder, config.json, MLflow parent run), or the run `run_id` continued when it
    exists with the same config."""
    run_id = run_id or f"{cfg.name}-{time.strftime('%Y%m%d-%H%M%S')}-{uuid.uuid4().hex[:6]}"
    run_dir = cfg.run_dir(run_id)
    config_json = cfg.model_dump_json(indent=2)
    tracker = Tracker(cfg.output_dir)
    tags = run_tags(cfg, run_id)
    if (run_dir / "config.json").exists():
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
    params.update(flatten(cfg.model_dump(mode="json")))
    mlflow_run_id = tracker.start_run(run_id, params, tags=tags)
    tracker.log_artifact(mlflow_run_id, run_dir / "config.json")
    print(f"run {run_id}: outputs in {run_dir}, MLflow run {mlflow_run_id} ({tracker.uri})")
    return RunContext(run_id, run_dir, mlflow_run_id, Path(cfg.output_dir), tags)


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
    return cfg, RunContext(run_id, run_dir, mlflow_run_id, Path(cfg.output_dir), run_tags(cfg, run_id))


def start_stage_run(ctx: RunContext, stage: str, params: dict) -> str:
    """The stage's nested MLflow run: the one an interrupted attempt started, or a new one."""
    tracker = Tracker(ctx.output_dir)
    existing = tracker.find_run({"rstar2.run_id": ctx.run_id, "rstar2.stage": stage}, ctx.mlflow_run_id)
    if existing is not None:
        tracker.reopen(existing)
        return existing
    return tracker.start_run(stage, params, parent_run_id=ctx.mlflow_run_id,
                             tags={"rstar2.run_id": ctx.run_id, **ctx.tags, "rstar2.stage": stage})
