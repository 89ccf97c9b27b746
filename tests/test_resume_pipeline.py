"""Resume after a crash: SIGKILL the pipeline in the middle of an RL stage, run it again with the
same run id, and check it against what its config implies for an uninterrupted run: every
(stage, step) part of every table once, with all its rows and no duplicate keys, every
checkpoint evaluated on every benchmark, and MLflow step histories with each step once. The
killed attempt trains on 2 ranks and the resume on 1, as on a cluster that lost a node: the
checkpoint's ZeRO state is re-partitioned. The run also evaluates the base model and a second
benchmark in a public data set's layout (JSONL). About 3 minutes on two cores."""

import json
import os
import signal
import subprocess
import time
from pathlib import Path

import duckdb
import pytest
from mlflow.tracking import MlflowClient

from tasks.data.problems import generate_problems
from tasks.tracking.mlflow_log import EXPERIMENT, tracking_uri
from tests.processes import placed_pids, wait_gone
from tests.small_run import run_command, small_run, stage

ROOT = Path(__file__).resolve().parents[1]
STAGES = [stage("stage1", 3), stage("hard", 1, hard_only=True, difficulty_attempts=2, reset_optimizer=True)]
SMALL = {**small_run(STAGES), "eval.base": True}
CHECKPOINTS = ["base", "sft", "stage1", "hard"]


# Two ranks and their engine and sandbox: 4 logical CPUs for the local Ray on 2 cores.
TWO_RANKS = {"trainer.ranks": 2, "cluster.num_cpus": 4}


def command(output_dir: Path, run_id: str, placement: dict | None = None) -> list[str]:
    # A benchmark in a public layout (JSONL, question/answer columns), from a disjoint seed.
    bench = output_dir / "mini-benchmark.jsonl"
    output_dir.mkdir(parents=True, exist_ok=True)
    bench.write_text(
        "".join(
            json.dumps({"question": p.question, "answer": int(p.answer)}) + "\n"
            for p in generate_problems(3, [1], seed=99)
        )
    )
    mini = {"name": "mini", "format": "jsonl", "path": str(bench), "problem": "question"}
    return run_command(run_id, {**SMALL, "output_dir": str(output_dir), "data.benchmarks": [mini], **(placement or {})})


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


def step_histories(output_dir: Path, run_id: str) -> list[tuple[str, list[int]]]:
    """(stage, steps with a reward_mean) of each MLflow run of the run, sorted: a stage twice is a
    run the resume opened again instead of reopening."""
    client = MlflowClient(tracking_uri(output_dir))
    experiment = client.get_experiment_by_name(EXPERIMENT)
    runs = client.search_runs([experiment.experiment_id], f"tags.`rstar2.run_id` = '{run_id}'")
    return sorted(
        (
            r.data.tags.get("rstar2.stage", "parent"),
            sorted(m.step for m in client.get_metric_history(r.info.run_id, "reward_mean")),
        )
        for r in runs
    )


@pytest.mark.slow
def test_a_killed_run_resumes_to_the_tables_of_an_uninterrupted_one(tmp_path) -> None:
    output, log = tmp_path, tmp_path / "run.log"
    run_dir = output / "runs" / "resume"
    marker = run_dir / "steps" / "stage=stage1" / "step=0" / "part-0.parquet"
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
    assert wait_gone(placed_pids(run_dir)) == []
    assert not (run_dir / "state" / "rl-stage1.json").exists()  # killed mid-stage
    killed_walls = json.loads((run_dir / "state" / "wall.json").read_text())
    run(output, "resume", log)  # on 1 rank
    assert "resuming with a new placement (cluster.num_cpus, trainer.ranks)" in log.read_text()
    assert "stage1: resuming at step 1 of 3" in log.read_text()
    assert (
        "checkpoint step-00000: saved by 2 ranks, loaded by 1 through DeepSpeed's universal format" in log.read_text()
    )
    assert wait_gone(placed_pids(run_dir)) == []

    # Every part an uninterrupted run writes, with all its rows, once: problems_per_step x 2G
    # rollouts per RL step, the held-out problems and the benchmark's x k per evaluation.
    heldout = duckdb.sql(f"SELECT count(*) FROM '{run_dir}/data/heldout.parquet'").fetchall()[0][0]
    drawn, k = 2 * 2 * SMALL["rl.group_size"], SMALL["eval.k"]
    rollouts = table_parts(run_dir, "rollouts")
    assert rollouts == {
        **{(name, step): (drawn, drawn) for name, steps in (("stage1", 3), ("hard", 1)) for step in range(steps)},
        **{(f"eval-{c}", 0): (heldout * k, heldout * k) for c in CHECKPOINTS},
        **{(f"eval-{c}-mini", 0): (3 * k, 3 * k) for c in CHECKPOINTS},
    }
    steps = table_parts(run_dir, "steps")  # (which metrics a step has depends on whether it updated)
    assert steps.keys() == {("stage1", 0), ("stage1", 1), ("stage1", 2), ("hard", 0)}
    assert all(rows == keys for rows, keys in steps.values())  # no metric twice
    evaluations = duckdb.sql(
        f"SELECT checkpoint, benchmark, problems, k, pass_at_1 FROM "
        f"read_parquet('{run_dir}/evaluations/*/*/*.parquet') ORDER BY ALL"
    ).fetchall()
    assert [r[:4] for r in evaluations] == [
        (c, b, n, k) for c in sorted(CHECKPOINTS) for b, n in (("heldout", heldout), ("mini", 3))
    ]
    assert all(0.0 <= r[4] <= 1.0 for r in evaluations)
    markdown = (run_dir / "summary.md").read_text()
    assert "| checkpoint | heldout pass@1 | mini pass@1 |" in markdown
    assert all(f"| {c} | " in markdown for c in CHECKPOINTS)
    # One MLflow run per stage, reopened by the resume, each RL step's metrics once
    histories = step_histories(output, "resume")
    assert histories == [("base", []), ("hard", [0]), ("parent", []), ("sft", []), ("stage1", [0, 1, 2])]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert [row["stage"] for row in summary["stages"]] == ["curate", "base model", "sft", "stage1", "hard"]
    # the base model, built by the killed attempt and skipped by the second, keeps its build time
    walls = {row["stage"]: row["wall s"] for row in summary["stages"]}
    assert walls["base model"] >= round(killed_walls["base model"], 1) > 0
