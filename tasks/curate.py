"""Prefect tasks of the curate stage and the consensus filter (library: tasks/data/problem_sets.py)."""

from __future__ import annotations

from pathlib import Path

from prefect import task
from prefect.artifacts import create_table_artifact
from prefect.cache_policies import NO_CACHE

from tasks.config import DataConfig
from tasks.data import problem_sets
from tasks.records import Problem, Rollouts, RunContext
from tasks.tracking.mlflow_log import Tracker


@task(cache_policy=NO_CACHE)
def curate_problems(data: DataConfig, run_dir: Path) -> dict:
    """Every source through the filters, then a seeded train / held-out split; returns the
    tables' paths and the rows each filter removed."""
    curated = problem_sets.curate(data, run_dir)
    create_table_artifact(curated["counts"], key="curation", description="Rows each curation filter removed")
    for c in curated["counts"]:
        print(f"curation {c['filter']:>16}: {c['in']:>6} in, {c['removed']:>6} removed, {c['kept']:>6} kept")
    return curated


@task(cache_policy=NO_CACHE)
def record_curation(ctx: RunContext, counts: list[dict]) -> None:
    """The per-filter counts as metrics of the run's MLflow parent run, the splits as its datasets."""
    metrics = {f"curation/{c['filter']}_removed": c["removed"] for c in counts}
    tracker = Tracker(ctx.output_dir)
    tracker.log_metrics(ctx.mlflow_run_id, {**metrics, "curation/kept": counts[-1]["kept"]}, 0)
    for split in ("train", "heldout"):
        tracker.log_dataset(ctx.mlflow_run_id, split, ctx.run_dir / "data" / f"{split}.parquet", split)


@task(cache_policy=NO_CACHE)
def keep_consensus(ctx: RunContext, attempts: Rollouts, m: int) -> list[str]:
    """The ids of the problems whose label the policy reached at least m times."""
    kept, counts = problem_sets.apply_consensus(ctx.run_dir, attempts, m)
    create_table_artifact(counts, key="curation", description="Rows each curation filter removed")
    Tracker(ctx.output_dir).log_metrics(
        ctx.mlflow_run_id,
        {"curation/consensus_removed": counts[-1]["removed"], "curation/kept_after_consensus": len(kept)},
    )
    print(
        f"curation        consensus: {counts[-1]['in']:>6} in, {counts[-1]['removed']:>6} removed, "
        f"{len(kept):>6} kept (label reached >= {m})"
    )
    return [p.problem_id for p in kept]


@task(cache_policy=NO_CACHE)
def load_problems(path: Path) -> list[Problem]:
    return problem_sets.load_problems(path)


@task(cache_policy=NO_CACHE)
def load_benchmarks(data: DataConfig) -> dict[str, list[Problem]]:
    """The configured evaluation benchmarks, by name."""
    return {source.name: problem_sets.load_benchmark(source, data) for source in data.benchmarks}


@task(cache_policy=NO_CACHE)
def select_problems(problems: list[Problem], ids: list[str]) -> list[Problem]:
    return problem_sets.select_problems(problems, ids)
