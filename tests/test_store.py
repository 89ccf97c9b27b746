"""Parquet writes are atomic and the README's DuckDB query works on the rollout layout.

Run: .venv/bin/python -m pytest tests/test_store.py -q
"""

import duckdb
import pyarrow as pa
import pytest

from tasks.store.tables import PROBLEMS, STEPS, read_table, step_part, write_table

ROW = {"problem_id": "a", "kind": "arithmetic", "level": 1, "question": "Compute 1 + 1.", "answer": "2",
       "solution_code": "print(1 + 1)"}


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
