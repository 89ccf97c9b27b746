"""The one place that talks to MLflow: the `Tracker` client, and a pipeline run's records (start
one, continue one with the same run id or a retried flow run, reopen a finished one for a later
evaluation, the nested run of a stage). Which run it is, and whether it may continue, is
tasks/store/run_folder.py's decision: MLflow records it.

Uses MlflowClient with explicit run ids rather than the fluent API: the fluent API keeps the
active run in thread-local state, and Prefect runs tasks on worker threads.
"""

from __future__ import annotations

import hashlib
import json
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

from mlflow.entities import Dataset, DatasetInput, InputTag, Metric, Param, RunStatus
from mlflow.tracking import MlflowClient

from tasks.config import RunConfig
from tasks.records import RunContext

EXPERIMENT = "rstar2-pipeline"


def tracking_uri(output_dir: str | Path) -> str:
    return f"sqlite:///{Path(output_dir).resolve() / 'mlflow.db'}"


class Tracker:
    """A pipeline run in MLflow: one parent run, one nested run per stage."""

    def __init__(self, output_dir: str | Path, experiment: str = EXPERIMENT):
        self.uri = tracking_uri(output_dir)
        Path(output_dir).mkdir(parents=True, exist_ok=True)
        self.client = MlflowClient(tracking_uri=self.uri)
        found = self.client.get_experiment_by_name(experiment)
        # Artifacts beside the database, so that all a run writes stays under the output folder.
        artifacts = (Path(output_dir).resolve() / "mlartifacts").as_uri()
        self.experiment_id = (
            found.experiment_id if found else self.client.create_experiment(experiment, artifact_location=artifacts)
        )

    def start_run(self, name: str, params: dict, parent_run_id: str | None = None, tags: dict | None = None) -> str:
        all_tags = dict(tags or {})
        if parent_run_id:
            all_tags["mlflow.parentRunId"] = parent_run_id
        run = self.client.create_run(self.experiment_id, run_name=name, tags=all_tags)
        run_id = run.info.run_id
        if params:
            # MLflow caps a param value at 6000 characters.
            batch = [Param(k, str(v)[:6000]) for k, v in params.items()]
            for start in range(0, len(batch), 100):
                self.client.log_batch(run_id, params=batch[start : start + 100])
        return run_id

    def find_run(self, tags: dict[str, str], parent_run_id: str | None = None) -> str | None:
        """The run with these tags (and this parent, or none): what a resumed run continues."""
        query = " and ".join(f"tags.`{k}` = '{v}'" for k, v in tags.items())
        for run in self.client.search_runs([self.experiment_id], query, max_results=50):
            if run.data.tags.get("mlflow.parentRunId") == parent_run_id:
                return run.info.run_id
        return None

    def reopen(self, run_id: str) -> None:
        self.client.update_run(run_id, status="RUNNING")

    def metric_steps(self, run_id: str, key: str) -> set[int]:
        return {m.step for m in self.client.get_metric_history(run_id, key)}

    def log_metrics(self, run_id: str, metrics: dict[str, float], step: int = 0) -> None:
        now = int(time.time() * 1000)
        batch = [Metric(k, float(v), now, step) for k, v in metrics.items() if v is not None]
        if batch:
            self.client.log_batch(run_id, metrics=batch)

    def log_step_once(self, run_id: str, metrics: dict[str, float], step: int) -> None:
        """A step's metrics, unless the run has them already (a resumed step that reached MLflow)."""
        if step not in self.metric_steps(run_id, "reward_mean"):
            self.log_metrics(run_id, metrics, step)

    def step_logger(self, run_id: str, marker: str) -> Callable[[dict[str, float], int], None]:
        """A `log(metrics, step)` that skips the steps an earlier attempt of the run logged (a
        rerun after a kill trains them again): each step once in MLflow's history, the metric
        `marker` telling which are there."""
        logged = self.metric_steps(run_id, marker)

        def log(metrics: dict[str, float], step: int) -> None:
            if step not in logged:
                self.log_metrics(run_id, metrics, step)

        return log

    def log_artifact(self, run_id: str, path: str | Path, folder: str | None = None) -> None:
        self.client.log_artifact(run_id, str(path), folder)

    def log_dataset(self, run_id: str, name: str, path: Path, context: str) -> None:
        """A Parquet table as a dataset input of the run (name, content digest, where it lies)."""
        digest = hashlib.sha256(Path(path).read_bytes()).hexdigest()[:16]
        dataset = Dataset(name=name, digest=digest, source_type="local", source=str(Path(path).resolve()))
        self.client.log_inputs(run_id, [DatasetInput(dataset, [InputTag("mlflow.data.context", context)])])

    def end_run(self, run_id: str, ok: bool = True) -> None:
        status = RunStatus.to_string(RunStatus.FINISHED if ok else RunStatus.FAILED)
        self.client.set_terminated(run_id, status=status)


def _git_commit() -> str:
    try:
        return (
            subprocess.run(
                ["git", "rev-parse", "--short", "HEAD"],
                capture_output=True,
                text=True,
                cwd=Path(__file__).parent,
                timeout=5,
            ).stdout.strip()
            or "unknown"
        )
    except OSError:
        return "unknown"


def run_tags(cfg: RunConfig, run_id: str) -> dict:
    # Every MLflow run of a pipeline run carries these; they filter and group runs in the UI
    # (e.g. tags.`rstar2.roc_mode` = 'off').
    return {
        "rstar2.run_id": run_id,
        "rstar2.config": cfg.name,
        "rstar2.roc_mode": cfg.rl.roc.mode,
        "rstar2.sft_mode": cfg.sft.mode,
        "rstar2.seed": str(cfg.seed),
        "rstar2.scheduler": cfg.engines.scheduler,
    }


def flatten(tree: dict, prefix: str = "") -> dict:
    """Nested config values as MLflow params with dotted keys (lists as JSON)."""
    flat = {}
    for key, value in tree.items():
        if isinstance(value, dict):
            flat.update(flatten(value, f"{prefix}{key}."))
        else:
            flat[f"{prefix}{key}"] = json.dumps(value) if isinstance(value, list) else value
    return flat


def pipeline_run(cfg: RunConfig, config_path: str, run_id: str, run_dir: Path) -> str:
    """The MLflow parent run of pipeline run `run_id` (whose folder tasks/store/run_folder.py has
    opened): the one an earlier attempt started, reopened, or a new one with the config as params."""
    tracker = Tracker(cfg.output_dir)
    existing = tracker.find_run({"rstar2.run_id": run_id})
    if existing is not None:
        tracker.reopen(existing)
        print(f"run {run_id}: resuming in {run_dir}, MLflow run {existing} ({tracker.uri})")
        return existing
    params = {"config_path": config_path, "git_commit": _git_commit(), "run_dir": str(run_dir)}
    params.update(flatten(cfg.model_dump(mode="json")))
    mlflow_run_id = tracker.start_run(run_id, params, tags=run_tags(cfg, run_id))
    tracker.log_artifact(mlflow_run_id, run_dir / "config.json")
    print(f"run {run_id}: outputs in {run_dir}, MLflow run {mlflow_run_id} ({tracker.uri})")
    return mlflow_run_id


def reopened_run(output_dir: str | Path, run_id: str) -> str:
    """The MLflow parent run of an earlier pipeline run, reopened (for a later evaluation)."""
    tracker = Tracker(output_dir)
    mlflow_run_id = tracker.find_run({"rstar2.run_id": run_id})
    if mlflow_run_id is None:
        raise ValueError(f"run {run_id} has no MLflow run in {tracker.uri}")
    tracker.reopen(mlflow_run_id)
    return mlflow_run_id


def start_stage_run(ctx: RunContext, stage: str, params: dict) -> str:
    """The stage's nested MLflow run: the one an interrupted attempt started, or a new one."""
    tracker = Tracker(ctx.output_dir)
    existing = tracker.find_run({"rstar2.run_id": ctx.run_id, "rstar2.stage": stage}, ctx.mlflow_run_id)
    if existing is not None:
        tracker.reopen(existing)
        return existing
    return tracker.start_run(
        stage,
        params,
        parent_run_id=ctx.mlflow_run_id,
        tags={"rstar2.run_id": ctx.run_id, **ctx.tags, "rstar2.stage": stage},
    )
