"""Parquet, JSON and text writes are atomic, stage wall times survive a resume, the README's
DuckDB query works on the rollout layout, and a run's identity leaves out its placement.

Run: .venv/bin/python -m pytest tests/test_store.py -q
"""

import json
import time

import duckdb
import pyarrow as pa
import pytest

from tasks.config import default_config_path, load_config
from tasks.store.run_folder import PLACEMENT, checkpoint_tag, open_run, prune_checkpoints, universal_copy
from tasks.store.tables import PROBLEMS, STEPS, read_table, step_part, write_json, write_table, write_text
from tasks.summary.run_card import Stopwatch

ROW = {
    "problem_id": "a",
    "kind": "arithmetic",
    "level": 1,
    "question": "Compute 1 + 1.",
    "answer": "2",
    "solution_code": "print(1 + 1)",
}


def test_write_then_read(tmp_path):
    path = write_table([ROW], PROBLEMS, tmp_path / "p.parquet")
    assert read_table(path) == [ROW]


def test_failed_write_keeps_the_old_file_and_leaves_no_temp(tmp_path):
    path = write_table([ROW], PROBLEMS, tmp_path / "p.parquet")
    with pytest.raises((pa.ArrowInvalid, pa.ArrowTypeError, TypeError)):
        write_table([{**ROW, "level": "not a number"}], PROBLEMS, path)
    assert read_table(path) == [ROW]
    assert [p.name for p in tmp_path.iterdir()] == ["p.parquet"]


def test_step_files_are_queryable_with_duckdb(tmp_path):
    for stage in ("stage1", "stage2"):
        for step in range(3):
            row = {"run_id": "r", "stage": stage, "step": step, "metric": "reward_mean", "value": step / 10}
            write_table([row], STEPS, step_part(tmp_path, "steps", stage, step))
    write_table([row], STEPS, step_part(tmp_path, "steps", "stage2", 2))  # a rerun replaces, not appends
    rows = duckdb.sql(
        f"SELECT stage, count(*) AS n, max(step) AS last FROM read_parquet('{tmp_path}/steps/*/*/*.parquet') "
        "GROUP BY stage ORDER BY stage"
    ).fetchall()
    assert rows == [("stage1", 3, 2), ("stage2", 3, 2)]


def test_json_write_failure_keeps_the_old_file_and_leaves_no_temp(tmp_path):
    path = write_json({"a": 1}, tmp_path / "state.json")
    with pytest.raises(TypeError):
        write_text(None, path)  # fails mid-write
    assert json.loads(path.read_text()) == {"a": 1}
    assert [p.name for p in tmp_path.iterdir()] == ["state.json"]


def test_stage_wall_times_add_up_over_a_runs_attempts(tmp_path):
    first = Stopwatch(tmp_path)
    time.sleep(0.05)
    base = first.lap("base model")
    second = Stopwatch(tmp_path)  # the run resumed: the base model is skipped, quickly
    assert second.lap("base model") >= base >= 0.05
    time.sleep(0.05)
    assert second.lap("sft") >= 0.05
    assert second.total() == pytest.approx(second.spent["base model"] + second.spent["sft"])
    assert Stopwatch(tmp_path).spent == second.spent


def test_a_run_resumes_with_another_placement_but_not_with_another_config(tmp_path):
    def config(**overrides):
        return load_config(default_config_path(), {"output_dir": str(tmp_path), **overrides})

    run_id, folder = open_run(config(), "r")
    assert (run_id, folder) == ("r", tmp_path / "runs" / "r")
    # Another cluster, more ranks and engines: the same run, and config.json records where it is now.
    moved = config(**{"cluster.address": "10.0.0.1:6379", "trainer.ranks": 2, "engines.count": 2})
    assert open_run(moved, "r") == (run_id, folder)
    assert json.loads((folder / "config.json").read_text())["cluster"]["address"] == "10.0.0.1:6379"
    recorded = (folder / "config.json").read_text()
    with pytest.raises(ValueError, match=r"\(rl\.optim\.lr, sft\.epochs differ\)"):
        open_run(config(**{"rl.optim.lr": 1e-3, "sft.epochs": 1, "sandbox.replicas": 3}), "r")
    assert (folder / "config.json").read_text() == recorded  # a refusal changes nothing
    assert open_run(config(), None)[0].startswith("tiny-")


def test_every_placement_field_is_a_field_of_the_config():
    tree = load_config(default_config_path()).model_dump()
    for path in PLACEMENT:
        node = tree
        for key in path.split("."):
            assert key in node, path
            node = node[key]


def test_pruning_keeps_the_newest_checkpoints_and_drops_their_universal_copies_with_them(tmp_path):
    for step in range(4):
        (tmp_path / checkpoint_tag(step)).mkdir()
    universal_copy(tmp_path, checkpoint_tag(1)).mkdir()
    universal_copy(tmp_path, checkpoint_tag(3)).mkdir()
    prune_checkpoints(tmp_path, keep=2)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-00002", "step-00003", "step-00003-universal"]
