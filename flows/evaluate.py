"""Evaluate: avg@k pass@1 of the current policy on the held-out split."""

from prefect import flow

from tasks.config import RunConfig
from tasks.data.problems import Problem
from tasks.report import summarize_eval
from tasks.rl_update import rollout_spec
from tasks.rollouts import roll_out, score, write_rollouts
from tasks.runtime import RunContext, Runtime


@flow(name="evaluate", log_prints=True, validate_parameters=False)
def evaluate(cfg: RunConfig, ctx: RunContext, runtime: Runtime, label: str, problems: list[Problem]) -> dict:
    problems = problems[: cfg.eval.n_problems] if cfg.eval.n_problems else problems
    spec = rollout_spec(cfg, cfg.eval.max_turns, cfg.eval.max_response_tokens, cfg.eval.temperature)
    rollouts = score(runtime, roll_out(runtime, problems, cfg.eval.k, spec, desc=f"eval {label}"))
    write_rollouts(ctx.run_id, ctx.run_dir, f"eval-{label}", 0, rollouts)
    return summarize_eval(ctx, label, rollouts, cfg.eval.k)
