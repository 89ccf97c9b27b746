"""The one place that talks to MLflow.

Uses MlflowClient with explicit run ids rather than the fluent API: the fluent API keeps the
active run in thread-local state, and Prefect runs tasks on worker threads.
"""

from __future__ import annotations

import hashlib
import time
from pathlib import Path

from mlflow.entities import Dataset, DatasetInput, InputTag, Metric, Param, RunStatus
from mlflow.tracking import MlflowClient

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
        self.experiment_id = found.experiment_id if found else self.client.create_experiment(
            experiment, artifact_location=artifacts)

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
