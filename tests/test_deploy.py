"""The Prefect UI workflow for real: `scripts/services.sh start` starts a Prefect server, a worker
and the MLflow UI on loopback and deploys prefect.yaml; the deployments are triggered with
parameters through the API (what the UI's Custom run form sends) and must complete. The stage
deployment runs the first RL stage of a new run, its worker and driver SIGKILLed once the run's
actors are up: the run shows as Crashed (its heartbeats stop) and the UI's Retry resumes it, what
it had finished not done again; while it waits to be marked Crashed, the evaluate deployment
evaluates the run's base model with another k; `stop` ends every service. About 5 minutes on two
cores."""

import os
import signal
import subprocess
import time
from pathlib import Path

import pytest
from prefect import get_client
from prefect.settings import PREFECT_API_URL, temporary_settings
from prefect.states import AwaitingRetry

from tasks.store.tables import partition, read_table
from tests.browser import _free_port
from tests.processes import placed_pids, wait_gone, wait_until
from tests.small_run import small_run, stage

pytestmark = pytest.mark.slow  # starts engines or trains

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "services.sh"
SMALL = {**small_run([stage("stage1", 1), stage("stage2", 1)]), "data.n_train": 24}


def _run_deployment(client, name: str, parameters: dict, worker_log: Path):
    deployment = client.read_deployment_by_name(name)
    flow_run = client.create_flow_run_from_deployment(deployment.id, parameters=parameters)
    deadline = time.monotonic() + 600
    while not (state := client.read_flow_run(flow_run.id).state).is_final():
        assert time.monotonic() < deadline, f"{name}: flow run still {state.name} after 10 minutes"
        time.sleep(2)
    assert state.is_completed(), (name, state, worker_log.read_text()[-3000:])


def _driver(flow_run_id) -> int:
    """The process the worker started for a flow run: the one carrying its id whose parent does
    not (the run's own children, Ray's processes among them, inherit the variable)."""

    def run_id_of(pid: str) -> str | None:
        try:
            entries = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        except OSError:
            return None
        return next((e.split(b"=", 1)[1].decode() for e in entries if e.startswith(b"PREFECT__FLOW_RUN_ID=")), None)

    mine = [pid for pid in os.listdir("/proc") if pid.isdigit() and run_id_of(pid) == str(flow_run_id)]
    parent = {pid: Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1] for pid in mine}
    (root,) = [pid for pid in mine if parent[pid] not in mine]
    return int(root)


def _wait_state(client, flow_run_id, done, what: str, timeout_s: float):
    deadline = time.monotonic() + timeout_s
    while not done(state := client.read_flow_run(flow_run_id).state):
        assert time.monotonic() < deadline, f"{what}: flow run still {state.name} after {timeout_s:.0f} s"
        time.sleep(2)
    return state


def test_pipeline_deployment_runs_from_the_api(tmp_path) -> None:
    prefect_port, mlflow_port = _free_port(), _free_port()
    env = {
        **os.environ,
        "PREFECT_PORT": str(prefect_port),
        "MLFLOW_PORT": str(mlflow_port),
        "RSTAR2_SERVICES_DIR": str(tmp_path / "services"),
        "PREFECT_HOME": str(tmp_path / "prefect"),
    }
    started = subprocess.run([str(SCRIPT), "start"], env=env, capture_output=True, text=True, timeout=600)
    assert started.returncode == 0, started.stderr
    try:
        assert f"http://127.0.0.1:{mlflow_port}" in started.stdout
        outputs = tmp_path / "outputs"
        parameters = {
            "config": "configs/tiny.yaml",
            "run_id": "deployed",
            "overrides": {**SMALL, "output_dir": str(outputs)},
            "stages": ["stage1"],
        }
        run_dir, worker_log = outputs / "runs" / "deployed", tmp_path / "services" / "prefect-worker.log"
        with (
            temporary_settings({PREFECT_API_URL: f"http://127.0.0.1:{prefect_port}/api"}),
            get_client(sync_client=True) as client,
        ):
            deployment = client.read_deployment_by_name("rstar2-pipeline/tiny")
            # The UI builds its run form from this schema: typed, with the config path defaulted.
            schema = deployment.parameter_openapi_schema["properties"]
            assert schema["config"]["type"] == "string" and deployment.parameters["config"] == "configs/tiny.yaml"
            assert schema["stages"]["anyOf"][0] == {"items": {"type": "string"}, "type": "array"}
            # The stage deployment's run of a new run. Its worker and driver are SIGKILLed once its
            # actors are up, as when their machine is lost: nothing reports the end, so the
            # heartbeats' automation marks the run Crashed; once a worker is back, the UI's Retry
            # resumes the run.
            staged = client.read_deployment_by_name("rstar2-pipeline/tiny-stage")
            flow_run = client.create_flow_run_from_deployment(staged.id, parameters=parameters)
            wait_until(lambda: (run_dir / "placement.json").exists(), "actors placed")
            base_done = (run_dir / "state" / "base.json").stat().st_mtime_ns
            driver, worker = _driver(flow_run.id), int((tmp_path / "services" / "prefect-worker.pid").read_text())
            os.kill(worker, signal.SIGKILL)
            os.kill(driver, signal.SIGKILL)
            assert not wait_gone([worker, driver])
            killed_at = time.monotonic()
            assert not wait_gone(placed_pids(run_dir))  # its actors and sandboxes went with it
            # A worker is back at once; while the dead run waits to be marked Crashed, the
            # evaluate deployment evaluates its base model with another k.
            restarted = subprocess.run([str(SCRIPT), "start"], env=env, capture_output=True, text=True, timeout=600)
            assert restarted.returncode == 0, restarted.stderr
            schema = client.read_deployment_by_name("rstar2-evaluate/evaluate").parameter_openapi_schema
            assert schema["required"] == ["run_id"] and schema["properties"]["checkpoint"]["default"] == "sft"
            _run_deployment(
                client,
                "rstar2-evaluate/evaluate",
                {
                    "run_id": "deployed",
                    "checkpoint": "base",
                    "label": "base-k4",
                    "eval_overrides": {"k": 4},
                    "output_dir": str(outputs),
                },
                worker_log,
            )
            crashed = _wait_state(client, flow_run.id, lambda s: s.is_crashed(), "SIGKILLed driver", 300)
            crash_s = time.monotonic() - killed_at
            assert "heartbeat" in crashed.message, crashed
            client.set_flow_run_state(flow_run.id, AwaitingRetry(message="Retry from the UI"), force=True)
            resumed = _wait_state(client, flow_run.id, lambda s: s.is_final(), "retried run", 600)
            assert resumed.is_completed(), (resumed, worker_log.read_text()[-3000:])
            print(f"crashed {crash_s:.0f} s after its driver was killed")
            # The retry did not redo what the killed attempt had finished, and ran the stage named.
            assert (run_dir / "state" / "base.json").stat().st_mtime_ns == base_done
            assert sorted(p.name for p in (run_dir / "models").iterdir()) == ["base", "sft", "stage1"]
            assert (run_dir / "steps" / "stage=stage1" / "step=0" / "part-0.parquet").exists()
        assert (run_dir / "summary.json").exists()
        evaluation = read_table(partition(run_dir, "evaluations", checkpoint="base-k4", benchmark="heldout"))
        assert [(row["checkpoint"], row["k"], row["problems"]) for row in evaluation] == [("base-k4", 4, 4)]
    finally:
        stopped = subprocess.run([str(SCRIPT), "stop"], env=env, capture_output=True, text=True, timeout=120)
    assert stopped.returncode == 0, stopped.stderr
    for name in ("prefect-server", "prefect-worker", "mlflow-ui"):
        assert not (tmp_path / "services" / f"{name}.pid").exists()
