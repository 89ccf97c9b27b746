"""The driver SIGKILLed at 10 seeded points of one run, resumed with the same run id after each:
the finished run's tables and MLflow step histories equal an uninterrupted run's, and nothing
any killed attempt started (its local Ray, actors, sandbox servers) is left running.

The kill points are drawn (seeded) from the run's phases in order: SFT, the evaluations, and in
each RL step the rollout, the update and the weight sync. A phase is seen from outside, as a
user would: the Prefect server this test starts on 127.0.0.1 says which task is running, in
which flow (and for an RL step, which stage and step); the kill comes a seeded moment after.

Not in `make test` (marker `soak`): about 15 minutes on two cores.

    .venv/bin/python -m pytest -m soak tests/test_driver_kill.py -q
"""

import asyncio
import json
import os
import random
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
from mlflow.tracking import MlflowClient

from tasks.tracking.mlflow_log import EXPERIMENT, tracking_uri
from tests.browser import _free_port
from tests.processes import placed_pids, wait_gone
from tests.small_run import small_run, stage
from tests.test_resume_pipeline import table_parts

pytestmark = [pytest.mark.slow, pytest.mark.soak]

ROOT = Path(__file__).resolve().parents[1]
SEED = 11
STAGES = [stage("stage1", 3), stage("hard", 1, hard_only=True, difficulty_attempts=2)]
STEP_TASKS = ("roll_out", "update_policy", "sync_weights")
# The phases of the run in order: (flow, task, what tells one apart). An RL step's are
# rollout, update, sync.
PHASES = (
    [("sft", "train_sft", None), ("evaluate", "roll_out", "sft")]
    + [
        ("rl-step", task, ("stage1", step))
        for step in range(3)
        for task in ("roll_out", "update_policy", "sync_weights")
    ]
    + [("evaluate", "roll_out", "stage1")]
    + [("rl-step", task, ("hard", 0)) for task in STEP_TASKS]
    + [("evaluate", "roll_out", "hard")]
)


def command(output_dir: Path, run_id: str) -> list[str]:
    overrides = {**small_run(STAGES), "output_dir": str(output_dir)}
    sets = [arg for key, value in overrides.items() for arg in ("--set", f"{key}={json.dumps(value)}")]
    config = str(ROOT / "configs" / "tiny.yaml")
    return [sys.executable, "-m", "flows.cli", "run", "--config", config, "--run-id", run_id, *sets]


def descendants(pid: int) -> list[int]:
    """Every process below `pid` now (Ray's head processes, actors, sandbox servers, cells)."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(entry.name))
    found, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


class PrefectServer:
    """A Prefect server of the test's own on 127.0.0.1, stopped by its pid."""

    def __init__(self, home: Path):
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}/api"
        env = {**os.environ, "PREFECT_HOME": str(home), "PREFECT_SERVER_ANALYTICS_ENABLED": "false"}
        command = [sys.executable, "-m", "prefect", "server", "start", "--host", "127.0.0.1"]
        self.process = subprocess.Popen(
            [*command, "--port", str(self.port)],
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,
        )
        deadline = time.monotonic() + 180
        while True:
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=2):
                    return
            except OSError:
                assert self.process.poll() is None and time.monotonic() < deadline, "no Prefect server"
                time.sleep(0.5)

    def stop(self) -> None:
        os.killpg(self.process.pid, signal.SIGTERM)
        self.process.wait(timeout=30)


async def running_phases(client, names: dict) -> set[tuple]:
    """The phases (as in PHASES) whose task is running now."""
    from prefect.client.schemas.filters import TaskRunFilter, TaskRunFilterState, TaskRunFilterStateType
    from prefect.client.schemas.objects import StateType

    running = TaskRunFilter(state=TaskRunFilterState(type=TaskRunFilterStateType(any_=[StateType.RUNNING])))
    phases = set()
    for task_run in await client.read_task_runs(task_run_filter=running):
        if task_run.flow_run_id not in names:
            flow_run = await client.read_flow_run(task_run.flow_run_id)
            flow = (await client.read_flow(flow_run.flow_id)).name
            p = flow_run.parameters
            detail = {"evaluate": p.get("label"), "rl-step": (p.get("stage", {}).get("name"), p.get("step"))}
            names[task_run.flow_run_id] = (flow, detail.get(flow))
        flow, detail = names[task_run.flow_run_id]
        phases.add((flow, task_run.name.rsplit("-", 1)[0], detail))
    return phases


async def kill_at(victim: subprocess.Popen, target: tuple, delay_s: float, api: str) -> tuple[set, list[int]]:
    """SIGKILL the driver (its process group) `delay_s` after the target phase is seen running;
    returns the phases running just before the kill and every process the driver had started."""
    from prefect.client.orchestration import get_client
    from prefect.settings import PREFECT_API_URL, temporary_settings

    names: dict = {}
    with temporary_settings({PREFECT_API_URL: api}):
        async with get_client() as client:
            deadline = time.monotonic() + 900
            while target not in await running_phases(client, names):
                assert victim.poll() is None, "the run ended before the kill point"
                assert time.monotonic() < deadline, f"never reached {target}"
                await asyncio.sleep(0.05)
            await asyncio.sleep(delay_s)
            running = await running_phases(client, names)
    pids = descendants(victim.pid)
    os.killpg(victim.pid, signal.SIGKILL)
    victim.wait()
    return running, pids


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


def test_a_run_killed_at_ten_points_resumes_to_the_uninterrupted_tables(tmp_path) -> None:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    reference, output = tmp_path / "reference", tmp_path / "killed"
    with (tmp_path / "reference.log").open("wb") as log:
        done = subprocess.run(command(reference, "run"), cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
    assert done.returncode == 0, (tmp_path / "reference.log").read_text()[-4000:]

    rng = random.Random(SEED)
    points = sorted(rng.sample(range(len(PHASES)), 10))
    server = PrefectServer(tmp_path / "prefect")
    env["PREFECT_API_URL"] = server.url
    started, hit = [], []
    log_path = tmp_path / "killed.log"
    try:
        for point in points:
            with log_path.open("ab") as log:
                victim = subprocess.Popen(
                    command(output, "run"),
                    cwd=ROOT,
                    env=env,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    start_new_session=True,
                )
            # SFT takes seconds, an RL phase a fraction of one: the moment within each is drawn.
            delay = rng.uniform(0, 5.0 if PHASES[point][0] == "sft" else 0.3)
            running, pids = asyncio.run(kill_at(victim, PHASES[point], delay, server.url))
            started += pids + placed_pids(output / "runs" / "run")
            hit.append((PHASES[point], sorted(running, key=str)))
        with log_path.open("ab") as log:
            done = subprocess.run(command(output, "run"), cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
        assert done.returncode == 0, log_path.read_text()[-4000:]
    finally:
        server.stop()
    print("\n".join(f"killed at {target}: running {running}" for target, running in hit))

    a, b = reference / "runs" / "run", output / "runs" / "run"
    assert table_parts(b, "rollouts") == table_parts(a, "rollouts")
    assert all(rows == keys for rows, keys in table_parts(b, "rollouts").values())
    assert table_parts(b, "steps").keys() == table_parts(a, "steps").keys()
    assert all(rows == keys for rows, keys in table_parts(b, "steps").values())
    assert sorted(p.name for p in (b / "evaluations").rglob("*.parquet")) == sorted(
        p.name for p in (a / "evaluations").rglob("*.parquet")
    )
    assert mlflow_histories(output, "run") == mlflow_histories(reference, "run")
    assert wait_gone(started + placed_pids(b)) == []
