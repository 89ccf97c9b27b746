"""End to end: the whole pipeline flow at a small size, with the real stack (Prefect, vLLM-CPU,
DeepSpeed-CPU, the sandbox service, MLflow on sqlite), checking what it wrote.

Run: .venv/bin/python -m pytest tests/test_pipeline.py -q   (about 2-3 minutes on 2 cores)
"""

import json
from pathlib import Path

import duckdb
import pytest
from mlflow.tracking import MlflowClient
from prefect import get_client
from prefect.testing.utilities import prefect_test_harness

from dashboards.views import connect
from flows.pipeline import pipeline
from tasks.data.problems import generate_problems
from tasks.sandbox.app import TOKEN_ENV
from tasks.tracking.mlflow_log import EXPERIMENT, tracking_uri

pytestmark = pytest.mark.slow  # starts engines or trains

CONFIG = Path(__file__).resolve().parent.parent / "configs" / "tiny.yaml"
STAGE = {"name": "stage1", "steps": 2, "max_response_tokens": 128, "max_turns": 3, "problems_per_step": 4}
# A second stage behind the difficulty filter (2 attempts per problem), optimizer reset.
HARD = {
    "name": "hard",
    "steps": 1,
    "max_response_tokens": 128,
    "max_turns": 3,
    "problems_per_step": 4,
    "hard_only": True,
    "difficulty_attempts": 2,
    "reset_optimizer": True,
}
STOP_REASONS = {"answer", "no_answer", "max_turns", "budget"}
CREDENTIAL = "the-e2e-runs-sandbox-credential"  # the run uses $RSTAR2_SANDBOX_TOKEN where it is set


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    output_dir = tmp_path_factory.mktemp("outputs")
    # A benchmark in a public layout (JSONL, question/answer columns), from a disjoint seed.
    bench = output_dir / "mini-benchmark.jsonl"
    bench.write_text(
        "".join(
            json.dumps({"question": p.question, "answer": int(p.answer)}) + "\n"
            for p in generate_problems(3, [1], seed=99)
        )
    )
    overrides = {
        "output_dir": str(output_dir),
        "data.n_train": 48,
        "data.n_heldout": 6,
        "model.tiny.pretrain_copy_steps": 0,
        "model.tiny.pretrain_steps": 2,
        "sft.n_examples": 96,
        "sft.epochs": 1,
        "rl.group_size": 4,
        "rl.stages": [STAGE, HARD],
        "eval.k": 2,
        "eval.max_turns": 3,
        "eval.max_response_tokens": 128,
        "eval.base": True,
        "data.benchmarks": [{"name": "mini", "format": "jsonl", "path": str(bench), "problem": "question"}],
    }
    with pytest.MonkeyPatch.context() as env, prefect_test_harness(server_startup_timeout=180):
        env.setenv(TOKEN_ENV, CREDENTIAL)
        result = pipeline(config=str(CONFIG), run_id="e2e", overrides=overrides)
        with get_client(sync_client=True) as client:  # while the test server is up
            result["artifacts"] = {a.key: a for a in client.read_artifacts() if a.key}
    return result, output_dir


def test_summary_has_every_stage(run):
    result, _ = run
    summary = json.loads((Path(result["run_dir"]) / "summary.json").read_text())
    assert [row["stage"] for row in summary["stages"]] == ["curate", "base model", "sft", "stage1", "hard"]
    for row in summary["stages"][1:]:
        assert 0.0 <= row["pass@1 after"] <= 1.0 and 0.0 <= row["tool-call rate"] <= 1.0
    assert [row["steps"] for row in summary["stages"][-2:]] == [2, 1]
    checkpoints = Path(result["run_dir"]) / "checkpoints" / "stage1"
    assert (checkpoints / "latest").read_text() == "step-00001"
    assert sorted(p.name for p in checkpoints.glob("step-*")) == ["step-00000", "step-00001"]


def test_the_sandbox_listens_on_loopback_and_its_credential_is_written_nowhere(run):
    result, output_dir = run
    actors = json.loads((Path(result["run_dir"]) / "placement.json").read_text())["actors"]
    urls = [actor["url"] for actor in actors if actor["role"] == "sandbox"]
    assert urls and all(url.startswith("http://127.0.0.1:") for url in urls)  # a local Ray: loopback
    assert "credential required" in (Path(result["run_dir"]) / "logs" / "sandbox-0.log").read_text()
    files = [path for path in output_dir.rglob("*") if path.is_file()]  # logs, tables, MLflow's database
    assert files and [str(path) for path in files if CREDENTIAL.encode() in path.read_bytes()] == []


def test_evaluation_table_compares_checkpoints_on_every_benchmark(run):
    result, _ = run
    rows = duckdb.sql(
        f"SELECT checkpoint, benchmark, problems, k, pass_at_1 FROM "
        f"read_parquet('{result['run_dir']}/evaluations/*/*/*.parquet') ORDER BY ALL"
    ).fetchall()
    assert [(r[0], r[1], r[2], r[3]) for r in rows] == [
        (c, b, n, 2) for c in ("base", "hard", "sft", "stage1") for b, n in (("heldout", 6), ("mini", 3))
    ]
    assert all(0.0 <= r[4] <= 1.0 for r in rows)
    summary = (Path(result["run_dir"]) / "summary.md").read_text()
    assert "| checkpoint | heldout pass@1 | mini pass@1 |" in summary
    assert all(f"| {c} | " in summary for c in ("base", "sft", "stage1", "hard"))


def test_rollout_rows_are_queryable_and_consistent(run):
    result, _ = run
    table = f"read_parquet('{result['run_dir']}/rollouts/*/*/*.parquet')"
    counts = dict(duckdb.sql(f"SELECT stage || '/' || step, count(*) FROM {table} GROUP BY ALL").fetchall())
    # RL steps: 4 problems x 2G = 8 rollouts each; evaluations: 6 held-out problems x k = 2, and
    # the 3 benchmark problems x k = 2.
    assert counts == {
        "stage1/0": 32,
        "stage1/1": 32,
        "hard/0": 32,
        "eval-base/0": 12,
        "eval-sft/0": 12,
        "eval-stage1/0": 12,
        "eval-hard/0": 12,
        "eval-base-mini/0": 6,
        "eval-sft-mini/0": 6,
        "eval-stage1-mini/0": 6,
        "eval-hard-mini/0": 6,
    }
    rows = duckdb.sql(f"SELECT * FROM {table}").df()
    assert set(rows["stop_reason"]) <= STOP_REASONS
    assert set(rows["reward"]) <= {0.0, 1.0}
    assert (rows[rows["predicted"].isna()]["reward"] == 0).all()  # invalid output: reward 0, no crash
    kept = duckdb.sql(
        f"SELECT step, problem_id, count(*) FILTER (kept) AS k, count(DISTINCT reward) AS classes "
        f"FROM {table} WHERE stage = 'stage1' GROUP BY ALL"
    ).fetchall()
    for _, _, k, classes in kept:
        assert k == (4 if classes == 2 else 0)  # G kept from groups with signal, none from the rest


README_QUERY = """
    SELECT run_id, stage, step, count(*) AS rollouts, avg(reward) AS reward,
           avg(tool_calls) AS tool_calls, sum(kept::INT) AS kept
    FROM rollouts GROUP BY ALL ORDER BY ALL
"""


def test_readme_query_runs_on_the_views(run):
    result, _ = run
    assert README_QUERY in (Path(__file__).resolve().parent.parent / "README.md").read_text()
    rows = connect(result["run_dir"]).sql(README_QUERY).fetchall()
    assert len(rows) == 11 and all(row[0] == "e2e" and row[3] in (6, 12, 32) for row in rows)
    metrics = connect(result["run_dir"]).sql("SELECT DISTINCT metric FROM steps").fetchall()
    assert ("reward_mean",) in metrics
    health = connect(result["run_dir"]).sql("SELECT * EXCLUDE (run_id, stage, step) FROM health").fetchall()
    assert len(health) == 3 and {value for row in health for value in row} == {0.0}  # no faults, none counted
    overlap = (
        connect(result["run_dir"])
        .sql("SELECT staleness_max, stale_dropped, rollouts_ahead, trainer_idle, engines_idle FROM asynchrony")
        .fetchall()
    )
    assert len(overlap) == 3 and all(row[:3] == (0.0, 0.0, 0.0) for row in overlap)  # rl.async off: on-policy
    assert all(0 < trainer < 1 and 0 < engines < 1 for *_, trainer, engines in overlap)


def test_mlflow_has_nested_stage_runs_with_step_metrics(run):
    _, output_dir = run
    client = MlflowClient(tracking_uri(output_dir))
    experiment = client.get_experiment_by_name(EXPERIMENT)
    runs = client.search_runs([experiment.experiment_id], "tags.`rstar2.run_id` = 'e2e'")
    parent = [r for r in runs if "mlflow.parentRunId" not in r.data.tags]
    assert len(parent) == 1 and parent[0].info.status == "FINISHED"
    stages = {
        r.data.tags["rstar2.stage"]: r for r in runs if r.data.tags.get("mlflow.parentRunId") == parent[0].info.run_id
    }
    assert set(stages) == {"base", "sft", "stage1", "hard"}
    difficulty = client.get_run(stages["hard"].info.run_id).data.metrics
    assert sum(difficulty[f"difficulty/solved_{j}_of_2"] for j in range(3)) == 48  # every train problem
    assert difficulty["difficulty/kept"] == 48 - difficulty["difficulty/solved_2_of_2"]
    assert [m.step for m in client.get_metric_history(stages["base"].info.run_id, "pretrain/loss")] == [0, 1]
    rl = stages["stage1"].info.run_id
    for metric in (
        "reward_mean",
        "kept",
        "dropped",
        "tool_calls",
        "tool_errors",
        "response_length_mean",
        "time_rollout_s",
        "time_tool_wait_s",
    ):
        assert [m.step for m in client.get_metric_history(rl, metric)] == [0, 1], metric
    assert "eval/stage1/pass_at_1" in parent[0].data.metrics
    # Tags to compare runs by, on the parent and every stage; the config and the data as inputs.
    for r in [parent[0], *stages.values()]:
        assert r.data.tags["rstar2.roc_mode"] == "paper" and r.data.tags["rstar2.config"] == "tiny"
    assert [a.path for a in client.list_artifacts(parent[0].info.run_id) if a.path == "config.json"] == ["config.json"]
    evaluations = {a.path for a in client.list_artifacts(parent[0].info.run_id, "evaluations/sft/heldout")}
    assert evaluations == {"evaluations/sft/heldout/part-0.parquet", "evaluations/sft/heldout/samples.json"}
    inputs = client.get_run(parent[0].info.run_id).inputs.dataset_inputs
    assert sorted(i.dataset.name for i in inputs) == ["heldout", "train"]


def test_readme_query_commands_return_the_expected_shape(run, capsys):
    """Every `rstar2 query` example of the README, through the command itself, on this run."""
    import shlex

    from flows.cli import main

    readme = (Path(__file__).resolve().parent.parent / "README.md").read_text()
    commands = [shlex.split(line)[1:] for line in readme.splitlines() if line.startswith(".venv/bin/rstar2 query ")]
    assert len(commands) == 4
    result, _ = run
    expected_columns = [
        ["stage", "step", "tool_error_rate", "calls"],
        ["problem_id"],
        ["checkpoint", "benchmark", "pass_at_1", "turns_mean", "tool_error_rate"],
        ["stage", "step", "reward"],
    ]
    for argv, columns in zip(commands, expected_columns):
        argv = [a for a in argv if a not in ("--runs", "outputs/runs/<run_id>")]
        sql = argv[1]
        rows = connect(result["run_dir"]).sql(sql)
        assert rows.columns[: len(columns)] == columns, sql
        assert len(rows.fetchall()) > 0, sql
        main(argv + ["--runs", result["run_dir"]])
        assert columns[0] in capsys.readouterr().out


def test_prefect_artifacts_summarise_curation_stages_and_progress(run):
    result, _ = run
    artifacts = result["artifacts"]
    assert {
        "curation",
        "run-summary",
        "stage-summary-stage1",
        "stage-summary-hard",
        "rl-progress-stage1",
        "difficulty-filter",
    } <= set(artifacts)
    assert artifacts["rl-progress-stage1"].data == 100.0
    stage1 = json.loads(artifacts["stage-summary-stage1"].data)
    assert [row["step"] for row in stage1] == [0, 1] and "reward_mean" in stage1[0]


# Ready when all six charts have drawn marks, the drill-down table is there and the trajectory
# text is shown; the value says what rendered.
DASHBOARD_READY = """(() => {
    const charts = document.querySelectorAll('[data-testid=stVegaLiteChart]');
    const drawn = [...charts].filter(c => c.querySelector('canvas, svg')).length;
    const table = document.querySelectorAll('[data-testid=stDataFrame]').length;
    const code = [...document.querySelectorAll('[data-testid=stCode]')].map(c => c.innerText).join('');
    return drawn >= 8 && table >= 1 && code.length > 0 ? {drawn, table, code: code.length} : null;
})()"""


def test_streamlit_dashboard_renders_charts_with_data(run):
    """The dashboard on this run in headless Chromium; the screenshot is kept under outputs/."""
    import subprocess
    import sys
    import time
    import urllib.request

    from tests.browser import _free_port, render

    result, _ = run
    root = Path(__file__).resolve().parent.parent
    port = _free_port()
    server = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "streamlit",
            "run",
            str(root / "dashboards" / "app.py"),
            "--server.headless=true",
            "--server.address=127.0.0.1",
            f"--server.port={port}",
            "--browser.gatherUsageStats=false",
            "--",
            "--runs",
            result["run_dir"],
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/_stcore/health", timeout=1) as response:
                    if response.read() == b"ok":
                        break
            except OSError:
                if time.monotonic() > deadline or server.poll() is not None:
                    raise
                time.sleep(0.2)
        screenshot = root / "outputs" / "test-artifacts" / "dashboard.png"
        rendered = render(f"http://127.0.0.1:{port}/", DASHBOARD_READY, screenshot)
    finally:
        server.terminate()
        server.wait(timeout=10)
    assert rendered and rendered["drawn"] >= 8 and rendered["code"] > 0, rendered
    assert screenshot.stat().st_size > 20_000
