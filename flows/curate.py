"""Curate: the problems the run trains and evaluates on."""

from prefect import flow

from tasks.config import DataConfig, RunConfig
from tasks.curate import curate_problems, keep_consensus, record_curation
from tasks.data.problems import Problem
from tasks.rl_update import rollout_spec
from tasks.rollouts import roll_out, score
from tasks.runtime import RunContext, Runtime


@flow(name="curate", log_prints=True)
def curate(data: DataConfig, ctx: RunContext) -> dict:
    curated = curate_problems(data, ctx.run_dir)
    record_curation(ctx, curated["counts"])
    return curated["paths"]


@flow(name="consensus-filter", log_prints=True, validate_parameters=False)
def consensus(cfg: RunConfig, ctx: RunContext, runtime: Runtime, problems: list[Problem]) -> list[Problem]:
    c = cfg.data.consensus
    spec = rollout_spec(cfg, c.max_turns, c.max_response_tokens, cfg.rollout.temperature)
    return keep_consensus(ctx, score(runtime, roll_out(runtime, problems, c.n, spec, desc="consensus")), c.m)
