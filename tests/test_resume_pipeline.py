"""Resume after a crash: SIGKILL the pipeline in the middle of an RL stage, run it again with the
same run id, and compare with an uninterrupted run of the same config: the same (stage, step)
parts of every table with the same row counts and no duplicate keys, and MLflow step histories
with each step once. The killed attempt trains on 2 ranks and the resume on 1, as on a cluster
that lost a node: the checkpoint's ZeRO state is re-partitioned. About 5 minutes on two cores
(three small pipeline runs)."""

import json
import os
import signal
import subprocess
import time
from pathlib import Path

import duckdb
import pytest
from mlflow.tracking import MlflowClient

from tasks.tracking.mlflow_log import EXPERIMENT, tracking_uri
from tests.processes import placed_pids, wait_gone
from tests.small_run import run_command, small_run, stage

ROOT = Path(__file__).resolve().parents[1]
STAGES = [stage("stage1", 3), stage("hard", 1, hard_only=True, difficulty_attempts=2, reset_optimizer=True)]
SMALL = small_run(STAGES)


# Two ranks and their engine and sandbox: 4 logical CPUs for the local Ray on 2 cores.
TWO_RANKS = {"trainer.ranks": 2, "cluster.num_cpus": 4}


def command(output_dir: Path, run_id: str, placement: dict | None = None) -> list[str]:
    return run_command(run_id, {**SMALL, "output_dir": str(output_dir), **(placement or {})})


def run(output_dir: Path, run_id: str, log: Path) -> None:
    with log.open("ab") as out:
        done = subprocess.run(command(output_dir, run_id), cwd=ROOT, stdout=out, stderr=subprocess.STDOUT, timeout=900)
    assert done.returncode == 0, log.read_text()[-4000:]


def table_parts(run_dir: Path, table: str) -> dict[tuple, tuple[int, int]]:
    """(stage, step) -> (rows, distinct keys) of a table."""
    key = "problem_id || ':' || sample" if table == "rollouts" else "metric"
    return {
        (stage, step): (rows, keys)
        for stage, step, rows, keys in duckdb.sql(
            f"SELECT stage, step, count(*), count(DISTINCT {key}) FROM "
            f"read_parquet('{run_dir}/{table}/*/*/*.parquet') GROUP BY ALL"
        ).fetchall()
    }


def step_histories(output_dir: Path, run_id: str) -> dict[str, list[int]]:
    client = MlflowClient(tracking_uri(output_dir))
    experiment = client.get_experiment_by_name(EXPERIMENT)
    runs = client.search_runs([experiment.experiment_id], f"tags.`rstar2.run_id` = '{run_id}'")
    return {
        r.data.tags.get("rstar2.stage", "parent"): sorted(
            m.step for m in client.get_metric_history(r.info.run_id, "reward_mean")
        )
        for r in runs
    }


@pytest.mark.slow
def test_a_killed_run_resumes_to_the_same_tables_as_an_uninterrupted_one(tmp_path) -> None:
    run(tmp_path / "a", "resume", tmp_path / "a.log")

    output = tmp_path / "b"
    log = tmp_path / "b.log"
    marker = output / "runs" / "resume" / "steps" / "stage=stage1" / "step=0" / "part-0.parquet"
    with log.open("wb") as out:
        victim = subprocess.Popen(
            command(output, "resume", TWO_RANKS), cwd=ROOT, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
        )
    deadline = time.monotonic() + 600
    while not marker.exists():
        assert victim.poll() is None, log.read_text()[-4000:]
        assert time.monotonic() < deadline, "the run never reached its first RL step"
        time.sleep(0.2)
    os.killpg(victim.pid, signal.SIGKILL)  # the flow and everything it started
    victim.wait()
    # Its local Ray shares the driver's fate: the actors, and the sandbox servers they started, go too.
    assert wait_gone(placed_pids(output / "runs" / "resume")) == []
    assert not (output / "runs" / "resume" / "state" / "rl-stage1.json").exists()  # killed mid-stage
    run(output, "resume", log)  # on 1 rank
    assert "resuming with a new placement (cluster.num_cpus, trainer.ranks)" in log.read_text()
    assert "stage1: resuming at step 1 of 3" in log.read_text()
    assert (
        "checkpoint step-00000: saved by 2 ranks, loaded by 1 through DeepSpeed's universal format" in log.read_text()
    )

    a, b = tmp_path / "a" / "runs" / "resume", output / "runs" / "resume"
    rollouts_a, rollouts_b = table_parts(a, "rollouts"), table_parts(b, "rollouts")
    assert rollouts_b == rollouts_a  # same (stage, step) parts, same row counts
    steps_a, steps_b = table_parts(a, "steps"), table_parts(b, "steps")
    assert steps_b.keys() == steps_a.keys()  # (which metrics a step has depends on whether it updated)
    for parts in (rollouts_b, steps_b):
        assert all(rows == keys for rows, keys in parts.values())  # no duplicate keys
    assert sorted(p.name for p in (b / "evaluations").glob("*.parquet")) == sorted(
        p.name for p in (a / "evaluations").glob("*.parquet")
    )
    histories = step_histories(output, "resume")
    assert histories == step_histories(tmp_path / "a", "resume")
    assert histories["stage1"] == [0, 1, 2] and histories["hard"] == [0]
    summary = json.loads((b / "summary.json").read_text())
    assert [row["stage"] for row in summary["stages"]] == ["curate", "base model", "sft", "stage1", "hard"]
    # the base model, built by the killed attempt and skipped by the second, keeps its build time
    walls = {row["stage"]: row["wall s"] for row in summary["stages"]}
    uninterrupted = {row["stage"]: row["wall s"] for row in json.loads((a / "summary.json").read_text())["stages"]}
    assert walls["base model"] >= 0.5 * uninterrupted["base model"] > 1
