"""Table schemas, defined once, and atomic Parquet writes.

Rows land under the run folder as one hive-style partition per (stage, step) or (checkpoint,
benchmark), e.g. `<run>/rollouts/stage=<stage>/step=<n>/part-0.parquet` (PARTITIONS), so
re-running a step replaces its file instead of appending duplicates, and a reader filtering on
stage or step opens only those folders. Every row also carries its run, stage and step, so a
file read on its own is complete; DuckDB reads a whole table with `read_parquet_sql(run, "rollouts")`.
"""

from __future__ import annotations

import json
import os
import tempfile
from dataclasses import asdict
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

PROBLEMS = pa.schema(
    [
        ("problem_id", pa.string()),
        ("kind", pa.string()),
        ("level", pa.int32()),
        ("question", pa.string()),
        ("answer", pa.string()),
        ("solution_code", pa.string()),
    ]
)

# Curation: a row set aside by a filter (or as malformed), and the rows each filter removed.
REJECTED = pa.schema(
    [("row_id", pa.string()), ("source", pa.string()), ("stage", pa.string()), ("reason", pa.string())]
)
CURATION = pa.schema([("filter", pa.string()), ("in", pa.int64()), ("removed", pa.int64()), ("kept", pa.int64())])

# One row per trajectory; `kept` and `advantage` are set by GRPO-RoC (eval rows: kept false).
ROLLOUTS = pa.schema(
    [
        ("run_id", pa.string()),
        ("stage", pa.string()),
        ("step", pa.int32()),
        ("problem_id", pa.string()),
        ("sample", pa.int32()),
        ("question", pa.string()),
        ("label", pa.string()),
        ("response", pa.string()),
        ("predicted", pa.string()),
        ("reward", pa.float32()),
        ("kept", pa.bool_()),
        ("advantage", pa.float32()),
        ("prompt_tokens", pa.int32()),
        ("response_tokens", pa.int32()),
        ("turns", pa.int32()),
        ("tool_calls", pa.int32()),
        ("tool_failures", pa.int32()),
        ("tool_statuses", pa.list_(pa.string())),
        ("stop_reason", pa.string()),
        # Policy versions count a stage's updates: the weights that drew the rollout, and those
        # an RL step trained on it (null outside RL steps); rl.async makes them differ.
        ("generated_version", pa.int32()),
        ("trained_version", pa.int32()),
        # Each assistant turn as the engines served it (tasks/records TurnTrace): the view `turns`
        # unnests them, one row per turn.
        (
            "turn_trace",
            pa.list_(
                pa.struct(
                    [
                        ("engine", pa.int32()),
                        ("context_tokens", pa.int32()),
                        ("added_tokens", pa.int32()),
                        ("generated_tokens", pa.int32()),
                        ("started_at", pa.float64()),
                        ("ended_at", pa.float64()),
                        ("tool_latency_s", pa.float64()),
                        ("tool_response_tokens", pa.int32()),
                    ]
                )
            ),
        ),
    ]
)

# One row per (stage, step): the metrics also sent to MLflow, queryable beside the rollouts.
STEPS = pa.schema(
    [
        ("run_id", pa.string()),
        ("stage", pa.string()),
        ("step", pa.int32()),
        ("metric", pa.string()),
        ("value", pa.float64()),
    ]
)


EVALUATIONS = pa.schema(
    [
        ("run_id", pa.string()),
        ("checkpoint", pa.string()),  # base, sft, or an RL stage's name
        ("benchmark", pa.string()),  # heldout, or a configured benchmark's name
        ("problems", pa.int64()),
        ("k", pa.int64()),
        ("pass_at_1", pa.float64()),  # avg@k: mean reward over problems and their k samples
        ("response_length_mean", pa.float64()),
        ("turns_mean", pa.float64()),
        ("tool_calls", pa.int64()),
        ("tool_errors", pa.int64()),
        ("tool_call_rate", pa.float64()),
        ("tool_error_rate", pa.float64()),
    ]
)


def write_table(rows: list[dict], schema: pa.Schema, path: Path) -> Path:
    """Write rows atomically: a reader sees the old file or the new one, never half of one."""
    table = pa.Table.from_pylist(rows, schema=schema)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    os.close(fd)
    try:
        pq.write_table(table, tmp)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path


def write_text(text: str, path: Path) -> Path:
    """Write text atomically (temp file + rename), like write_table."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path


def write_json(value, path: Path) -> Path:
    return write_text(json.dumps(value, indent=1, default=str), path)


def read_table(path: Path) -> list[dict]:
    return pq.read_table(path).to_pylist()


# How each partitioned table lies in a run folder, `<run>/<table>/<key>=<value>/.../part-0.parquet`:
# its partition keys in order, with their DuckDB types (dashboards/views.sql reads them from here).
PARTITIONS = {
    "rollouts": {"stage": "VARCHAR", "step": "INTEGER"},
    "steps": {"stage": "VARCHAR", "step": "INTEGER"},
    "evaluations": {"checkpoint": "VARCHAR", "benchmark": "VARCHAR"},
}


def partition(run_dir: Path, table: str, **keys) -> Path:
    """The file of one hive-style partition of `table` (keys as PARTITIONS names them)."""
    if list(keys) != list(PARTITIONS[table]):
        raise ValueError(f"table {table} is partitioned by {list(PARTITIONS[table])}, not {list(keys)}")
    return run_dir.joinpath(table, *(f"{k}={v}" for k, v in keys.items()), "part-0.parquet")


def read_parquet_sql(runs: str | Path, table: str) -> str:
    """DuckDB's read of every partition of `table` in the run folders `runs` (a folder or a glob),
    with the partition keys as typed columns."""
    keys = PARTITIONS[table]
    glob = f"{runs}/{table}/" + "*/" * len(keys) + "*.parquet"
    types = ", ".join(f"'{k}': {t}" for k, t in keys.items())
    return f"read_parquet('{glob}', union_by_name = true, hive_partitioning = true, hive_types = {{{types}}})"


def step_part(run_dir: Path, table: str, stage: str, step: int) -> Path:
    return partition(run_dir, table, stage=stage, step=step)


def evaluation_rows(run_dir: Path) -> list[dict]:
    """Every row of a run's evaluations table, in the order the evaluations were written."""
    parts = sorted(
        (run_dir / "evaluations").glob("*/" * len(PARTITIONS["evaluations"]) + "part-0.parquet"),
        key=lambda p: p.stat().st_mtime_ns,
    )
    return [row for part in parts for row in read_table(part)]


def stage_steps(run_dir: Path, stage: str) -> dict[int, dict[str, float]]:
    """step -> {metric: value} of one RL stage, from the steps table, in step order."""
    steps: dict[int, dict[str, float]] = {}
    for part in (run_dir / "steps" / f"stage={stage}").glob("step=*/part-0.parquet"):
        for row in read_table(part):
            steps.setdefault(row["step"], {})[row["metric"]] = row["value"]
    return dict(sorted(steps.items()))


def rollout_rows(
    run_id: str,
    stage: str,
    step: int,
    rollouts,
    kept: list[bool] | None = None,
    advantages: list[float] | None = None,
    trained_version: int | None = None,
) -> list[dict]:
    """ROLLOUTS rows for scored rollouts (tasks.records.Rollouts), in order."""
    questions = {p.problem_id: p.question for p in rollouts.problems}
    labels = {p.problem_id: p.answer for p in rollouts.problems}
    rows = []
    for i, traj in enumerate(rollouts.trajectories):
        rows.append(
            {
                "run_id": run_id,
                "stage": stage,
                "step": step,
                "problem_id": traj.problem_id,
                "sample": traj.sample,
                "question": questions[traj.problem_id],
                "label": labels[traj.problem_id],
                "response": traj.response,
                "predicted": rollouts.predicted[i],
                "reward": rollouts.rewards[i],
                "kept": bool(kept[i]) if kept else False,
                "advantage": advantages[i] if advantages else 0.0,
                "prompt_tokens": len(traj.prompt_ids),
                "response_tokens": len(traj.response_ids),
                "turns": traj.turns,
                "tool_calls": len(traj.tool_calls),
                "tool_failures": sum(c.status.is_failure for c in traj.tool_calls),
                "tool_statuses": [c.status.value for c in traj.tool_calls],
                "stop_reason": traj.stop_reason,
                "generated_version": None if trained_version is None else traj.policy_version,
                "trained_version": trained_version,
                "turn_trace": [asdict(t) for t in traj.turn_traces],
            }
        )
    return rows
