"""Curate: the problems the run trains and evaluates on."""

from pathlib import Path

from prefect import flow

from tasks.config import DataConfig
from tasks.curate import generate_splits


@flow(name="curate", log_prints=True)
def curate(data: DataConfig, run_dir: Path) -> dict[str, Path]:
    return generate_splits(data, run_dir)
