"""Bad input stops `rstar2 run` before anything is written: an impossible cluster config, an
unreachable Ray address, a malformed config field, a data row without an answer, a model
directory without weights. Each ends with one line on stderr naming what and where, exit status
2, and no run folder, MLflow database or anything else under output_dir. No Ray, no training.

Run: .venv/bin/python -m pytest tests/test_bad_input.py -q
"""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from flows.preflight import check_model
from tasks.config import InputError, load_config

ROOT = Path(__file__).resolve().parents[1]
TINY = ROOT / "configs" / "tiny.yaml"


def rstar2(*args: str, timeout: float = 60) -> subprocess.CompletedProcess:
    env = {key: value for key, value in os.environ.items() if key != "RAY_ADDRESS"}
    return subprocess.run(
        [sys.executable, "-m", "flows.cli", *args],
        cwd=ROOT,
        env={**env, "OMP_NUM_THREADS": "1"},
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def refused(out: Path, *args: str, config: Path = TINY, command: str = "run", timeout: float = 60) -> str:
    """Run `rstar2 <command>` with output_dir=out; assert exit 2, one line on stderr and no
    traceback, and that nothing was written under out. Returns the line."""
    run_args = ["--run-id", "bad"] if command == "run" else ["--name", "bad"]
    result = rstar2(command, "--config", str(config), *run_args, "--set", f"output_dir={out}", *args, timeout=timeout)
    assert result.returncode == 2, result.stderr
    assert "Traceback" not in result.stderr
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, result.stderr
    # The run folder and the MLflow database (tasks/tracking/mlflow_log.py) would be the first writes.
    assert not (out / "runs").exists() and not (out / "mlflow.db").exists()
    assert not out.exists(), sorted(out.rglob("*"))
    return lines[0]


def test_an_impossible_cluster_config(tmp_path):
    line = refused(tmp_path / "out", "--set", "cluster.num_cpus=2", "--set", "trainer.ranks=64")
    assert line.startswith("trainer.cpus: 64 ranks x 1 CPU need 64 CPUs, the cluster has 2")


def test_an_unreachable_ray_address_fails_in_seconds(tmp_path):
    line = refused(tmp_path / "out", "--set", "cluster.address=127.0.0.1:1", timeout=30)
    assert line.startswith("cluster.address: no Ray cluster answers at 127.0.0.1:1 (")


def test_a_malformed_field_from_the_command_line(tmp_path):
    line = refused(tmp_path / "out", "--set", "rl.stages.0.steps=abc")
    assert line.startswith(f"{TINY}: rl.stages.0.steps: Input should be a valid integer")
    assert line.endswith("(got 'abc')")


def test_a_malformed_field_in_a_yaml_file(tmp_path):
    config = tmp_path / "bad.yaml"
    config.write_text(TINY.read_text().replace("group_size: 8", "group_size: eight"))
    line = refused(tmp_path / "out", config=config)
    assert line.startswith(f"{config}: rl.group_size: Input should be a valid integer")
    assert line.endswith("(got 'eight')")


def test_a_data_row_without_an_answer(tmp_path):
    data = tmp_path / "problems.jsonl"
    data.write_text('{"problem": "What is 6 * 7?", "answer": "42"}\n{"problem": "What is 2 + 2?"}\n')
    line = refused(tmp_path / "out", "--set", f"data.sources=[{{name: mine, format: jsonl, path: {data}}}]")
    assert line.startswith(f"{data}, row 1: missing answer (answer);")


def test_a_model_directory_without_weights(tmp_path):
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    line = refused(tmp_path / "out", "--set", f"model.path={model}")
    assert line == f"model.path: {model}: no weights (*.safetensors or pytorch_model*.bin)"


def test_ablate_checks_before_its_first_run(tmp_path):
    line = refused(tmp_path / "out", "--set", "rl.roc.mode=sometimes", command="ablate")
    assert line.startswith(f"{TINY}: rl.roc.mode: Input should be 'paper', 'release' or 'off'")


def test_coldstart_checks_before_its_first_run(tmp_path):
    line = refused(tmp_path / "out", "--set", "sft.mode=thinking", command="coldstart")
    assert line.startswith(f"{TINY}: sft.mode: Input should be 'non_reasoning' or 'reasoning'")


@pytest.mark.parametrize(
    "files, message",
    [
        ([], "no such directory"),
        (["model.safetensors"], "no config.json"),
        (["config.json", "model.safetensors.index.json"], "no weights"),
    ],
)
def test_a_model_directory_needs_its_config_and_weights(tmp_path, files, message):
    model = tmp_path / "model"
    for name in files:
        model.mkdir(exist_ok=True)
        (model / name).write_text("{}")
    with pytest.raises(InputError, match=f"^model.path: {model}: {message}"):
        check_model(str(model))


def test_a_model_directory_with_sharded_weights_passes(tmp_path):
    for name in ("config.json", "model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"):
        (tmp_path / name).write_text("{}")
    check_model(str(tmp_path))
    check_model(load_config(TINY).model.path)  # None: the tiny model, built by the run


def test_the_pipeline_flow_checks_before_it_writes(tmp_path, prefect_api):
    """A run triggered from the UI, not the CLI, fails the same way before its first write."""
    from flows.pipeline import pipeline

    out = tmp_path / "out"
    with pytest.raises(InputError, match="^model.path: "):
        pipeline(config=str(TINY), run_id="bad", overrides={"output_dir": str(out), "model.path": str(tmp_path)})
    assert not out.exists()
