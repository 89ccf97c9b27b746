"""Prefect tasks of the curate stage."""

from __future__ import annotations

from pathlib import Path

from prefect import task
from prefect.cache_policies import NO_CACHE

from tasks.config import DataConfig
from tasks.data.problems import Problem, generate_problems, split_problems
from tasks.store.tables import PROBLEMS, read_table, write_table


@task(cache_policy=NO_CACHE)
def generate_splits(data: DataConfig, run_dir: Path) -> dict[str, Path]:
    """Generated problems, split into train and held-out Parquet files."""
    problems = generate_problems(data.n_train + data.n_heldout, data.levels, data.seed)
    train, heldout = split_problems(problems, data.n_heldout, data.seed)
    return {
        name: write_table([p.to_row() for p in split], PROBLEMS, run_dir / "data" / f"{name}.parquet")
        for name, split in (("train", train), ("heldout", heldout))
    }


def load_problems(path: Path) -> list[Problem]:
    return [Problem(**row) for row in read_table(path)]
