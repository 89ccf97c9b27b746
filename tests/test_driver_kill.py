"""The driver SIGKILLed at 10 seeded points of one run, resumed with the same run id after each:
the finished run's tables and MLflow step histories equal an uninterrupted run's, and nothing
any killed attempt started (its local Ray, actors, sandbox servers) is left running.

The kill points are drawn (seeded) from the run's phases in order: SFT, two of the three
evaluations, and seven of the RL steps' rollouts, updates and weight syncs. A phase is seen from outside, as an
operator would: the file the phase before it writes (a stage's record, a step's rollouts part, a
step's checkpoint), written by this attempt, and then the process the phase keeps busy (the
engine generates, the trainer rank steps). The kill comes a seeded moment after.

Not in `make test` (marker `soak`): about 10 minutes on two cores.

    .venv/bin/python -m pytest -m soak tests/test_driver_kill.py -q
"""

import json
import os
import random
import signal
import subprocess
import time
from pathlib import Path

import pytest
from mlflow.tracking import MlflowClient

from tasks.tracking.mlflow_log import EXPERIMENT, tracking_uri
from tests.processes import descendants, placed_pids, wait_busy, wait_gone
from tests.small_run import run_command, small_run, stage
from tests.test_resume_pipeline import table_parts

pytestmark = [pytest.mark.slow, pytest.mark.soak]

ROOT = Path(__file__).resolve().parents[1]
SEED = 11
STAGES = [stage("stage1", 3), stage("hard", 1, hard_only=True, difficulty_attempts=2)]
STEP_PHASES = ("rollout", "update", "sync")
# The phases of the run in order.
PHASES = (
    [("sft",), ("eval", "sft")]
    + [(phase, "stage1", step) for step in range(3) for phase in STEP_PHASES]
    + [("eval", "stage1")]
    + [(phase, "hard", 0) for phase in STEP_PHASES]
    + [("eval", "hard")]
)
# How far into a phase the kill may come, seconds: SFT lasts seconds, an RL phase a fraction of one.
REACH = {"sft": 3.0, "eval": 0.2, "rollout": 0.2, "update": 0.3, "sync": 0.05}


def command(output_dir: Path, run_id: str) -> list[str]:
    # The small run's policy solves nothing yet: groups without signal still make an update (of
    # zero advantages), so that every step trains, checkpoints and syncs.
    return run_command(run_id, {**small_run(STAGES), "output_dir": str(output_dir), "rl.roc.drop_zero_signal": False})


def written_since(path: Path, since: float, victim: subprocess.Popen, content: str | None = None) -> None:
    """Until this attempt (started at `since`) has written `path` (with `content`, if given)."""
    deadline = time.monotonic() + 900
    while True:
        try:
            if path.stat().st_mtime >= since and (content is None or path.read_text().strip() == content):
                return
        except OSError:
            pass
        assert victim.poll() is None, f"the run ended before it wrote {path}"
        assert time.monotonic() < deadline, f"{path} never came"
        time.sleep(0.02)


def actor_pid(run_dir: Path, since: float, victim: subprocess.Popen, role: str) -> int:
    """Index 0 of the role, as this attempt placed it."""
    written_since(run_dir / "placement.json", since, victim)
    actors = json.loads((run_dir / "placement.json").read_text())["actors"]
    return next(a["pid"] for a in actors if (a["role"], a["index"]) == (role, 0))


def reach(phase: tuple, run_dir: Path, since: float, victim: subprocess.Popen) -> None:
    """Return once the attempt is in `phase`."""
    kind, *where = phase
    state = run_dir / "state"
    if kind == "sft":  # the ranks start stepping once every actor is placed
        wait_busy(actor_pid(run_dir, since, victim, "trainer"))
    elif kind == "eval":  # after the stage it evaluates
        written_since(state / ("sft.json" if where[0] == "sft" else f"rl-{where[0]}.json"), since, victim)
        wait_busy(actor_pid(run_dir, since, victim, "engine"))
    else:
        stage_name, step = where
        if kind == "rollout":
            before = (
                run_dir / "steps" / f"stage={stage_name}" / f"step={step - 1}" / "part-0.parquet"
                if step
                else state / ("eval-sft.json" if stage_name == "stage1" else f"difficulty-{stage_name}.json")
            )
            written_since(before, since, victim)
            wait_busy(actor_pid(run_dir, since, victim, "engine"))
        elif kind == "update":
            written_since(
                run_dir / "rollouts" / f"stage={stage_name}" / f"step={step}" / "part-0.parquet", since, victim
            )
            wait_busy(actor_pid(run_dir, since, victim, "trainer"))
        else:  # sync: right after the step's checkpoint
            latest = run_dir / "checkpoints" / stage_name / "latest"
            written_since(latest, since, victim, f"step-{step:05d}")


def mlflow_histories(output_dir: Path, run_id: str) -> dict[tuple[str, str], list[int]]:
    """(stage run, metric) -> the steps MLflow holds, for the per-step metrics of SFT and RL."""
    client = MlflowClient(tracking_uri(output_dir))
    experiment = client.get_experiment_by_name(EXPERIMENT)
    histories = {}
    for run in client.search_runs([experiment.experiment_id], f"tags.`rstar2.run_id` = '{run_id}'"):
        stage_name = run.data.tags.get("rstar2.stage", "parent")
        for metric in ("reward_mean", "sft/loss", "pretrain/loss"):
            steps = sorted(m.step for m in client.get_metric_history(run.info.run_id, metric))
            if steps:
                histories[(stage_name, metric)] = steps
    return histories


def test_a_run_killed_at_ten_points_resumes_to_the_uninterrupted_tables(tmp_path, prefect_api) -> None:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PREFECT_API_URL": prefect_api}
    reference, output = tmp_path / "reference", tmp_path / "killed"
    with (tmp_path / "reference.log").open("wb") as log:
        done = subprocess.run(command(reference, "run"), cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
    assert done.returncode == 0, (tmp_path / "reference.log").read_text()[-4000:]

    # SFT, two of the three evaluations, seven of the twelve RL step phases: every kind is hit.
    rng = random.Random(SEED)
    evals = [i for i, phase in enumerate(PHASES) if phase[0] == "eval"]
    steps = [i for i, phase in enumerate(PHASES) if phase[0] in STEP_PHASES]
    points = sorted([PHASES.index(("sft",)), *rng.sample(evals, 2), *rng.sample(steps, 7)])
    run_dir, log_path = output / "runs" / "run", tmp_path / "killed.log"
    started, victim = [], None
    try:
        for point in points:
            since = time.time()
            with log_path.open("ab") as log:
                victim = subprocess.Popen(
                    command(output, "run"),
                    cwd=ROOT,
                    env=env,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    start_new_session=True,
                )
            reach(PHASES[point], run_dir, since, victim)
            time.sleep(rng.uniform(0, REACH[PHASES[point][0]]))
            started += descendants(victim.pid) + placed_pids(run_dir)
            os.killpg(victim.pid, signal.SIGKILL)
            victim.wait()
            print(f"killed in {PHASES[point]} after {time.time() - since:.0f} s")
        with log_path.open("ab") as log:
            done = subprocess.run(command(output, "run"), cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
        assert done.returncode == 0, log_path.read_text()[-4000:]
    finally:
        if victim is not None and victim.poll() is None:  # a kill point never reached
            os.killpg(victim.pid, signal.SIGKILL)

    a = reference / "runs" / "run"
    assert table_parts(run_dir, "rollouts") == table_parts(a, "rollouts")
    assert all(rows == keys for rows, keys in table_parts(run_dir, "rollouts").values())
    assert table_parts(run_dir, "steps").keys() == table_parts(a, "steps").keys()
    assert all(rows == keys for rows, keys in table_parts(run_dir, "steps").values())
    assert sorted(p.name for p in (run_dir / "evaluations").rglob("*.parquet")) == sorted(
        p.name for p in (a / "evaluations").rglob("*.parquet")
    )
    assert mlflow_histories(output, "run") == mlflow_histories(reference, "run")
    assert wait_gone(started + placed_pids(run_dir)) == []
