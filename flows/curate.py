"""Curate: the problems the run trains and evaluates on."""

from prefect import flow

from tasks.config import DataConfig
from tasks.curate import curate_problems, record_curation
from tasks.runtime import RunContext


@flow(name="curate", log_prints=True)
def curate(data: DataConfig, ctx: RunContext) -> dict:
    curated = curate_problems(data, ctx.run_dir)
    record_curation(ctx, curated["counts"])
    return curated["paths"]
