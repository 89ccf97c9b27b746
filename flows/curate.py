"""Curate: the problems the run trains and evaluates on."""

from prefect import flow

from flows.once import run_once
from tasks.config import DataConfig, RunConfig
from tasks.curate import curate_problems, keep_consensus, record_curation, select_problems
from tasks.policy import roll_out, score
from tasks.records import Problem, RunContext
from tasks.runtime import Runtime


@flow(name="curate", log_prints=True)
def curate(data: DataConfig, ctx: RunContext) -> dict:
    def work(_) -> dict:
        curated = curate_problems(data, ctx.run_dir)
        record_curation(ctx, curated["counts"])
        return curated["paths"]

    return run_once(ctx, "curate", work)


@flow(name="consensus-filter", log_prints=True, validate_parameters=False)
def consensus(cfg: RunConfig, ctx: RunContext, runtime: Runtime, problems: list[Problem]) -> list[Problem]:
    c = cfg.data.consensus

    def attempt(_) -> list[str]:
        return keep_consensus(ctx, score(runtime, roll_out(runtime, problems, c.n, c, desc="consensus")), c.m)

    return select_problems(problems, run_once(ctx, "consensus", attempt))
