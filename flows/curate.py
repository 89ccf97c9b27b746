"""Curate: the problems the run trains and evaluates on."""

from prefect import flow

from tasks.config import DataConfig, RunConfig
from tasks.curate import curate_problems, keep_consensus, problem_ids, record_curation, select_problems
from tasks.data.problems import Problem
from tasks.resume import finished, mark_finished
from tasks.rl_update import rollout_spec
from tasks.rollouts import roll_out, score
from tasks.runtime import RunContext, Runtime


@flow(name="curate", log_prints=True)
def curate(data: DataConfig, ctx: RunContext) -> dict:
    if (done := finished(ctx, "curate")) is not None:
        return done
    curated = curate_problems(data, ctx.run_dir)
    record_curation(ctx, curated["counts"])
    return mark_finished(ctx, "curate", curated["paths"])


@flow(name="consensus-filter", log_prints=True, validate_parameters=False)
def consensus(cfg: RunConfig, ctx: RunContext, runtime: Runtime, problems: list[Problem]) -> list[Problem]:
    if (kept := finished(ctx, "consensus")) is None:
        c = cfg.data.consensus
        spec = rollout_spec(cfg, c.max_turns, c.max_response_tokens, cfg.rollout.temperature)
        attempts = score(runtime, roll_out(runtime, problems, c.n, spec, desc="consensus"))
        kept = mark_finished(ctx, "consensus", problem_ids(keep_consensus(ctx, attempts, c.m)))
    return select_problems(problems, kept)
