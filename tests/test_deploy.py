"""The Prefect UI workflow for real: `scripts/services.sh start` starts a Prefect server, a worker
and the MLflow UI on loopback and deploys prefect.yaml; the pipeline deployment is triggered with
parameters through the API (what the UI's Custom run form sends) and must complete; `stop` ends
every service. About 3 minutes on two cores."""

import os
import subprocess
import time
from pathlib import Path

from prefect import get_client
from prefect.settings import PREFECT_API_URL, temporary_settings

from tests.browser import _free_port

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "services.sh"
SMALL = {"data.n_train": 24, "data.n_heldout": 4, "model.tiny.pretrain_steps": 2, "sft.n_examples": 64,
         "sft.epochs": 1, "rl.group_size": 4, "eval.k": 2, "eval.max_turns": 2, "eval.max_response_tokens": 96,
         "rl.stages": [{"name": "stage1", "steps": 1, "max_response_tokens": 96, "max_turns": 2,
                        "problems_per_step": 2}]}


def test_pipeline_deployment_runs_from_the_api(tmp_path) -> None:
    prefect_port, mlflow_port = _free_port(), _free_port()
    env = {**os.environ, "PREFECT_PORT": str(prefect_port), "MLFLOW_PORT": str(mlflow_port),
           "RSTAR2_SERVICES_DIR": str(tmp_path / "services"), "PREFECT_HOME": str(tmp_path / "prefect")}
    started = subprocess.run([str(SCRIPT), "start"], env=env, capture_output=True, text=True, timeout=600)
    assert started.returncode == 0, started.stderr
    try:
        assert f"http://127.0.0.1:{mlflow_port}" in started.stdout
        parameters = {"config": "configs/tiny.yaml", "run_id": "deployed",
                      "overrides": {**SMALL, "output_dir": str(tmp_path / "outputs")}}
        with temporary_settings({PREFECT_API_URL: f"http://127.0.0.1:{prefect_port}/api"}), \
                get_client(sync_client=True) as client:
            deployment = client.read_deployment_by_name("rstar2-pipeline/tiny")
            # The UI builds its run form from this schema: typed, with the config path defaulted.
            schema = deployment.parameter_openapi_schema["properties"]
            assert schema["config"]["type"] == "string" and deployment.parameters["config"] == "configs/tiny.yaml"
            flow_run = client.create_flow_run_from_deployment(deployment.id, parameters=parameters)
            deadline = time.monotonic() + 600
            while not (state := client.read_flow_run(flow_run.id).state).is_final():
                assert time.monotonic() < deadline, f"flow run still {state.name} after 10 minutes"
                time.sleep(2)
        assert state.is_completed(), (state, (tmp_path / "services" / "prefect-worker.log").read_text()[-3000:])
        assert (tmp_path / "outputs" / "runs" / "deployed" / "summary.json").exists()
    finally:
        stopped = subprocess.run([str(SCRIPT), "stop"], env=env, capture_output=True, text=True, timeout=120)
    assert stopped.returncode == 0, stopped.stderr
    for name in ("prefect-server", "prefect-worker", "mlflow-ui"):
        assert not (tmp_path / "services" / f"{name}.pid").exists()
