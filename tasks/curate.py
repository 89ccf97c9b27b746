"""Prefect tasks of the curate stage: load every source, filter, split, and report the counts."""

from __future__ import annotations

from dataclasses import asdict
from pathlib import Path

import pyarrow as pa
from prefect import task
from prefect.artifacts import create_table_artifact
from prefect.cache_policies import NO_CACHE

from tasks.config import DataConfig, SourceConfig
from tasks.data.curation import curate_rows, integer_answers
from tasks.data.problems import Problem, generate_problems, split_problems
from tasks.data.sources import RawProblem, Rejected, load_source
from tasks.rl.batch import solved_attempts
from tasks.rollouts import Rollouts
from tasks.runtime import RunContext
from tasks.store.tables import PROBLEMS, read_table, write_table

REJECTED = pa.schema([("row_id", pa.string()), ("source", pa.string()), ("stage", pa.string()),
                      ("reason", pa.string())])  # fmt: skip
CURATION = pa.schema([("filter", pa.string()), ("in", pa.int64()), ("removed", pa.int64()), ("kept", pa.int64())])


def read_source(source: SourceConfig, data: DataConfig) -> tuple[list[RawProblem], list[Rejected], dict[str, Problem]]:
    """(rows, malformed rows, the generated Problems by id, which keep their solution code)."""
    if source.format == "generated":
        problems = generate_problems(data.n_train + data.n_heldout, data.levels, data.seed)
        rows = [RawProblem(p.problem_id, source.name, p.question, p.answer) for p in problems]
        return rows, [], {p.problem_id: p for p in problems}
    rows, rejected = load_source(source.name, source.format, Path(source.path), source.problem, source.answer,
                                 source.id, source.split, source.limit)
    return rows, rejected, {}


def load_benchmark(source: SourceConfig, data: DataConfig) -> list[Problem]:
    """An evaluation set: its well-formed rows with integer answers, as problems."""
    rows, _, generated = read_source(source, data)
    rows, _ = integer_answers(rows)
    return [generated.get(r.row_id) or Problem(r.row_id, r.source, 0, r.question, r.answer, "") for r in rows]


@task(cache_policy=NO_CACHE)
def curate_problems(data: DataConfig, run_dir: Path) -> dict:
    """Every source through the filters, then a seeded train / held-out split. Writes
    data/{train,heldout}.parquet, data/rejected.parquet (row id, source, filter, reason) and
    data/curation.parquet (rows in / removed / kept per filter); returns the paths and counts."""
    rows: list[RawProblem] = []
    rejected: list[Rejected] = []
    generated: dict[str, Problem] = {}
    for source in data.sources:
        source_rows, malformed, source_generated = read_source(source, data)
        rows += source_rows
        rejected += malformed
        generated.update(source_generated)
    evaluation = [RawProblem(p.problem_id, p.kind, p.question, p.answer)
                  for source in data.benchmarks for p in load_benchmark(source, data)]  # fmt: skip
    malformed = len(rejected)
    kept, removed, counts = curate_rows(rows, evaluation, data.max_answer_digits, data.near_duplicate_threshold,
                                        data.decontamination_ngram)
    counts.insert(0, {"filter": "malformed", "in": len(rows) + malformed, "removed": malformed, "kept": len(rows)})
    rejected += removed
    problems = [generated.get(r.row_id) or Problem(r.row_id, r.source, 0, r.question, r.answer, "") for r in kept]
    if len(problems) <= data.n_heldout:
        raise ValueError(f"curation kept {len(problems)} problems, not more than data.n_heldout={data.n_heldout}: "
                         f"nothing would be left to train on (see {run_dir / 'data' / 'rejected.parquet'})")
    train, heldout = split_problems(problems, data.n_heldout, data.seed)
    out = run_dir / "data"
    paths = {name: write_table([p.to_row() for p in split], PROBLEMS, out / f"{name}.parquet")
             for name, split in (("train", train), ("heldout", heldout))}  # fmt: skip
    paths["rejected"] = write_table([asdict(r) for r in rejected], REJECTED, out / "rejected.parquet")
    paths["curation"] = write_table(counts, CURATION, out / "curation.parquet")
    create_table_artifact(counts, key="curation", description="Rows each curation filter removed")
    for c in counts:
        print(f"curation {c['filter']:>16}: {c['in']:>6} in, {c['removed']:>6} removed, {c['kept']:>6} kept")
    return {"paths": paths, "counts": counts}


@task(cache_policy=NO_CACHE)
def keep_consensus(ctx: RunContext, rollouts: Rollouts, m: int) -> list[Problem]:
    """The consensus filter: keep the problems whose label the policy reached at least m times.
    Adds its row to data/curation.parquet and data/rejected.parquet, and its count to MLflow."""
    solved = solved_attempts([t.problem_id for t in rollouts.trajectories], rollouts.rewards)
    n = len(rollouts.trajectories) // max(len(rollouts.problems), 1)
    kept = [p for p in rollouts.problems if solved.get(p.problem_id, 0) >= m]
    out = ctx.run_dir / "data"
    counts = read_table(out / "curation.parquet")
    counts.append({"filter": "consensus", "in": len(rollouts.problems), "removed": len(rollouts.problems) - len(kept),
                   "kept": len(kept)})
    rejected = read_table(out / "rejected.parquet") + [
        {"row_id": p.problem_id, "source": p.kind, "stage": "consensus",
         "reason": f"label reached {solved.get(p.problem_id, 0)} of {n} times (< {m})"}
        for p in rollouts.problems if solved.get(p.problem_id, 0) < m]
    write_table(rejected, REJECTED, out / "rejected.parquet")
    write_table(counts, CURATION, out / "curation.parquet")
    create_table_artifact(counts, key="curation", description="Rows each curation filter removed")
    ctx.tracker.log_metrics(ctx.mlflow_run_id, {"curation/consensus_removed": counts[-1]["removed"],
                                                "curation/kept_after_consensus": len(kept)})
    if not kept:
        raise ValueError(f"the consensus filter kept no problem (none solved {m} of {n} times); lower "
                         "data.consensus.m or leave the filter off until the policy can solve some")
    print(f"curation        consensus: {len(rollouts.problems):>6} in, {counts[-1]['removed']:>6} removed, "
          f"{len(kept):>6} kept (label reached >= {m} of {n})")
    return kept


@task(cache_policy=NO_CACHE)
def load_benchmarks(data: DataConfig) -> dict[str, list[Problem]]:
    """The configured evaluation benchmarks, by name."""
    return {source.name: load_benchmark(source, data) for source in data.benchmarks}


def problem_ids(problems: list[Problem]) -> list[str]:
    return [p.problem_id for p in problems]


@task(cache_policy=NO_CACHE)
def select_problems(problems: list[Problem], ids: list[str]) -> list[Problem]:
    """The problems with these ids, in their original order (a filter's recorded choice)."""
    keep = set(ids)
    return [p for p in problems if p.problem_id in keep]


def load_problems(path: Path) -> list[Problem]:
    return [Problem(**row) for row in read_table(path)]


@task(cache_policy=NO_CACHE)
def record_curation(ctx: RunContext, counts: list[dict]) -> None:
    """The per-filter counts as metrics of the run's MLflow parent run."""
    metrics = {f"curation/{c['filter']}_removed": c["removed"] for c in counts}
    metrics["curation/kept"] = counts[-1]["kept"]
    tracker = ctx.tracker
    tracker.log_metrics(ctx.mlflow_run_id, metrics, 0)
    for split in ("train", "heldout"):
        tracker.log_dataset(ctx.mlflow_run_id, split, ctx.run_dir / "data" / f"{split}.parquet", split)
