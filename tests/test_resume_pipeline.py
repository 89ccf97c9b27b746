"""A run killed anywhere resumes to what its config implies. The pipeline (under rl.async one_step,
or bounded) is stopped at seeded points (SIGTERM first, then SIGKILL) and run again with the same
run id after each:

- The first attempt trains on 2 ranks and is stopped with SIGTERM (as a Prefect cancel or a
  scheduler stops it) after stage 1's first checkpoint, while it draws the next step's rollouts
  ahead: it exits by itself with 143, without a retry, and leaves nothing running. The others
  resume on 1 rank, as on a cluster that lost a node: the checkpoint's ZeRO state is
  re-partitioned.
- Each later kill point is the k-th rollout an attempt keeps (k seeded), then a seeded moment
  more, so kills land in a step's own rollouts, in the rollouts drawn ahead during an update, in
  the update, the checkpoint and the weight push.
- In `make test`'s case the attempt after the driver's kill loses its trainer rank instead: the
  rank's process is SIGKILLed in a step's update while the next step's rollouts are drawn ahead.
  The step fails, its drawing ahead stops before any other turn or tool call goes out, and
  Prefect's flow retry (cluster.flow_retries) finishes the run with new actors.

Each rollout is kept as it finishes (tasks/store/inflight.py). After every kill the test reads
what the dead attempt had kept; the finished run must hold each of those rollouts unchanged (the
same response, drawn by the same policy version: not drawn again). The finished run has every
(stage, step) part of every table once, with all its rows and no duplicate keys, every checkpoint
evaluated on every benchmark (the base model's too, and a second benchmark in a public data set's
layout, JSONL), and MLflow step histories with each step once. From the second attempt on, the
engine and the trainer rank run on cores of their own (split placement), as rl.async means to run.

The first kill point and the rank's death are part of `make test`; ten kill points, and four under
rl.async bounded (rollouts drawn up to 2 versions ahead, kept and dropped by whole groups), under
the soak marker:

    .venv/bin/python -m pytest -m soak tests/test_resume_pipeline.py -q -s
"""

import json
import os
import random
import signal
import subprocess
import time
from pathlib import Path

import duckdb
import pytest
from mlflow.tracking import MlflowClient

from tasks.config.update import AsyncConfig
from tasks.data.problems import generate_problems
from tasks.store import inflight
from tasks.tracking.mlflow_log import EXPERIMENT, tracking_uri
from tests.processes import descendants, placed_pids, wait_busy, wait_gone, wait_until
from tests.small_run import run_command, small_run, stage

ROOT = Path(__file__).resolve().parents[1]
STEPS = {1: 3, 4: 6, 10: 10}  # kill points -> stage 1's steps: enough rollouts for every kill to land
CHECKPOINTS = ["base", "sft", "stage1", "hard"]
RUN = {
    "eval.base": True,
    "rl.async": {"mode": "one_step"},
    "rl.loss.is_cap": 2.0,
    "rl.roc.drop_zero_signal": False,  # every step updates, so every step draws the next ahead
    "cluster.placement": "split",
    "trainer.threads": 1,
}
# Two ranks and their engine and sandbox: 4 logical CPUs for the local Ray on 2 cores.
TWO_RANKS = {"trainer.ranks": 2, "cluster.num_cpus": 4}


def config(steps: int, asynchrony: str) -> dict:
    stages = [stage("stage1", steps), stage("hard", 1, hard_only=True, difficulty_attempts=2, reset_optimizer=True)]
    return {**small_run(stages), **RUN, "rl.async": {"mode": asynchrony}}


def command(output_dir: Path, steps: int, asynchrony: str, placement: dict | None = None) -> list[str]:
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
    overrides = {
        **config(steps, asynchrony),
        "output_dir": str(output_dir),
        "data.benchmarks": [mini],
        **(placement or {}),
    }
    return run_command("resume", overrides)


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


def kept_rollouts(run_dir: Path) -> dict[tuple[str, int, str, int], tuple[str, int]]:
    """(stage, step, problem, sample) -> (response, version) of every rollout kept in flight now."""
    kept = {}
    for folder in (run_dir / "inflight").glob("*/step=*"):
        stage_name, step = folder.parent.name, int(folder.name.split("=")[1])
        for trajectory in inflight.finished(folder).values():
            key = (stage_name, step, trajectory.problem_id, trajectory.sample)
            kept[key] = (trajectory.response, trajectory.policy_version)
    return kept


def rank_dies_in_an_update(run_dir: Path, log_path: Path, since: float) -> dict:
    """SIGKILL the trainer rank of the attempt that began at `since` once it is busy in stage 1's
    step-1 update (its rollouts written by this attempt, step 2's being drawn ahead); return what
    was kept in flight once the failed step's drawing ahead had stopped."""
    placement = run_dir / "placement.json"
    rollouts = run_dir / "rollouts" / "stage=stage1" / "step=1" / "part-0.parquet"
    wait_until(lambda: placement.exists() and placement.stat().st_mtime >= since, "this attempt's placement", 600)
    rank = next(a["pid"] for a in json.loads(placement.read_text())["actors"] if a["role"] == "trainer")
    wait_until(lambda: rollouts.exists() and rollouts.stat().st_mtime >= since, "step 1's rollouts", 600)
    wait_busy(rank, timeout_s=60)
    os.kill(rank, signal.SIGKILL)
    wait_until(lambda: "drawing ahead stopped" in log_path.read_text(), "the drawing ahead stopping", 300)
    return kept_rollouts(run_dir)


def kept_since(run_dir: Path, since: float) -> int:
    """Rollouts kept in flight since `since`, as far as this look finds: a step's folder goes
    while it is read once the step is recorded (the caller looks again)."""
    kept = 0
    try:
        for path in (run_dir / "inflight").rglob("*.json"):
            kept += path.stat().st_mtime >= since
    except FileNotFoundError:
        pass
    return kept


@pytest.mark.parametrize(
    "points, asynchrony, rank_dies",
    [
        pytest.param(1, "one_step", True, marks=pytest.mark.slow),
        pytest.param(10, "one_step", False, marks=[pytest.mark.slow, pytest.mark.soak]),
        pytest.param(4, "bounded", False, marks=[pytest.mark.slow, pytest.mark.soak]),
    ],
)
def test_a_run_killed_anywhere_resumes_to_what_its_config_implies(
    tmp_path, points, asynchrony, rank_dies, prefect_api
) -> None:
    rng, steps = random.Random(points), STEPS[points]
    output, log_path = tmp_path, tmp_path / "run.log"
    run_dir = output / "runs" / "resume"
    first_checkpoint = run_dir / "steps" / "stage=stage1" / "step=0" / "part-0.parquet"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PREFECT_API_URL": prefect_api}
    started, snapshots, kills, victim, killed_walls = [], {}, [], None, None
    began = time.monotonic()
    try:
        while len(kills) < points:
            since, on_two_ranks = time.time(), not kills
            with log_path.open("ab") as log:
                victim = subprocess.Popen(
                    command(output, steps, asynchrony, TWO_RANKS if on_two_ranks else None),
                    cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                )  # fmt: skip
            k, delay = rng.randint(1, 4), rng.uniform(0, 1.5)
            deadline = time.monotonic() + 600
            while victim.poll() is None and not (
                (first_checkpoint.exists() or not on_two_ranks)
                and (run_dir / "inflight").exists()
                and kept_since(run_dir, since) >= k
            ):
                assert time.monotonic() < deadline, "the attempt reached no kill point in 10 minutes"
                time.sleep(0.02)
            if victim.poll() is not None:  # it finished before this kill point
                break
            time.sleep(delay)
            started += descendants(victim.pid) + placed_pids(run_dir)
            if on_two_ranks:  # stopped as Prefect's cancel or a scheduler stops it: SIGTERM to the driver
                attempt_log = log_path.stat().st_size
                os.kill(victim.pid, signal.SIGTERM)
                assert victim.wait(timeout=120) == 128 + signal.SIGTERM, log_path.read_text()[-4000:]
                stopped = log_path.read_text()[attempt_log:]
                assert "Crashed('Execution was aborted by a termination signal.')" in stopped, stopped[-4000:]
                assert "AwaitingRetry" not in stopped, stopped[-4000:]  # not taken for a fault
                assert wait_gone(started) == [], "the stopped attempt left processes running"
            else:
                os.killpg(victim.pid, signal.SIGKILL)  # the flow and everything it started
                victim.wait()
            snapshots.update(kept_rollouts(run_dir))
            kills.append((k, round(delay, 2)))
            if on_two_ranks:
                assert not (run_dir / "state" / "rl-stage1.json").exists()  # killed mid-stage
                killed_walls = json.loads((run_dir / "state" / "wall.json").read_text())
        if victim.returncode != 0:  # the last one was stopped: finish the run
            since = time.time()
            with log_path.open("ab") as log:
                victim = subprocess.Popen(
                    command(output, steps, asynchrony),
                    cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                )  # fmt: skip
            if rank_dies:
                snapshots.update(rank_dies_in_an_update(run_dir, log_path, since))
                started += placed_pids(run_dir)  # the failed attempt's actors, which its retry replaces
            assert victim.wait(timeout=900) == 0, log_path.read_text()[-4000:]
    finally:
        if victim is not None and victim.poll() is None:
            os.killpg(victim.pid, signal.SIGKILL)

    text = log_path.read_text()
    assert "resuming with a new placement (cluster.num_cpus, trainer.ranks)" in text
    assert f"stage1: resuming at step 1 of {steps}" in text
    if rank_dies:  # the failed update's drawing ahead started nothing more; the retry went on from step 0
        assert "RankDied: trainer rank 0 on node " in text, text[-4000:]
        stopped = next(line for line in text.splitlines() if "drawing ahead stopped" in line)
        print(stopped.split("|")[-1].strip())
        assert stopped.endswith("having started since: 0 turns, 0 tool calls"), stopped
        assert text.count(f"stage1: resuming at step 1 of {steps}") == 2
    assert "checkpoint step-00000: saved by 2 ranks, loaded by 1 through DeepSpeed's universal format" in text

    # No finished rollout drawn again, every (problem, sample) of every step once, within the lag.
    rows = duckdb.sql(
        f"SELECT stage, step, problem_id, sample, response, generated_version, trained_version "
        f"FROM read_parquet('{run_dir}/rollouts/*/*/*.parquet', hive_partitioning = true) "
        f"WHERE stage IN ('stage1', 'hard')"
    ).fetchall()
    final = {(name, step, p, s): (response, gen) for name, step, p, s, response, gen, _ in rows}
    redrawn = sorted(key for key, kept in snapshots.items() if final.get(key) != kept)
    print(
        f"{len(kills)} kills (k-th kept rollout, delay s) {kills}; {len(snapshots)} finished rollouts in flight at "
        f"the kills, {len(redrawn)} drawn again; {time.monotonic() - began:.0f} s"
    )
    assert len(kills) == points, f"the run finished after {len(kills)} of {points} kill points"
    assert snapshots, "no kill found a finished rollout in flight"
    assert redrawn == []
    assert len(rows) == len(final)
    limit = AsyncConfig(mode=asynchrony).staleness_limit  # one_step: one version behind at most; bounded: 2
    assert all(0 <= trained - gen <= limit for *_, gen, trained in rows)
    versions: dict[tuple, set[int]] = {}  # (stage, step, problem) -> the versions that drew its group
    for name, step, problem, _, _, gen, _ in rows:
        versions.setdefault((name, step, problem), set()).add(gen)
    assert all(len(drawn_by) == 1 for drawn_by in versions.values())  # no group mixes policies
    assert sum(trained - gen for *_, gen, trained in rows) > 0  # and drawn ahead, at least once
    assert not (run_dir / "inflight").exists()

    # Every part an uninterrupted run writes, with all its rows, once: problems_per_step x 2G
    # rollouts per RL step, the held-out problems and the benchmark's x k per evaluation.
    small = config(steps, asynchrony)
    heldout = duckdb.sql(f"SELECT count(*) FROM '{run_dir}/data/heldout.parquet'").fetchall()[0][0]
    drawn, k = 2 * 2 * small["rl.group_size"], small["eval.k"]
    assert table_parts(run_dir, "rollouts") == {
        **{(name, step): (drawn, drawn) for name, n in (("stage1", steps), ("hard", 1)) for step in range(n)},
        **{(f"eval-{c}", 0): (heldout * k, heldout * k) for c in CHECKPOINTS},
        **{(f"eval-{c}-mini", 0): (3 * k, 3 * k) for c in CHECKPOINTS},
    }
    parts = table_parts(run_dir, "steps")  # (which metrics a step has depends on whether it updated)
    assert parts.keys() == {*(("stage1", step) for step in range(steps)), ("hard", 0)}
    assert all(rows == keys for rows, keys in parts.values())  # no metric twice
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
    # One MLflow run per stage, reopened by each resume, each RL step's metrics once
    histories = step_histories(output, "resume")
    assert histories == [("base", []), ("hard", [0]), ("parent", []), ("sft", []), ("stage1", list(range(steps)))]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert [row["stage"] for row in summary["stages"]] == ["curate", "base model", "sft", "stage1", "hard"]
    # the base model, built by the first attempt and skipped by the others, keeps its build time
    walls = {row["stage"]: row["wall s"] for row in summary["stages"]}
    assert walls["base model"] >= round(killed_walls["base model"], 1) > 0

    cores = {a["role"]: set(a["cores"]) for a in json.loads((run_dir / "placement.json").read_text())["actors"]}
    if len(os.sched_getaffinity(0)) > 1:
        assert cores["engine"] and cores["trainer"] and not cores["engine"] & cores["trainer"], cores
    assert wait_gone(started + placed_pids(run_dir)) == []
