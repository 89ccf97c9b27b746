"""Evaluate: avg@k pass@1 of the current policy on the held-out split and each benchmark."""

from prefect import flow

from tasks.config import RunConfig
from tasks.data.problems import Problem
from tasks.report import summarize_eval
from tasks.resume import finished, mark_finished
from tasks.rl_update import rollout_spec
from tasks.rollouts import roll_out, score, write_rollouts
from tasks.runtime import RunContext, Runtime


@flow(name="evaluate", log_prints=True, validate_parameters=False)
def evaluate(cfg: RunConfig, ctx: RunContext, runtime: Runtime, label: str, heldout: list[Problem],
             benchmarks: dict[str, list[Problem]] | None = None) -> dict:
    """Returns the held-out split's metrics; every benchmark's go to MLflow and the tables."""
    if (done := finished(ctx, f"eval-{label}")) is not None:
        return done
    spec = rollout_spec(cfg, cfg.eval.max_turns, cfg.eval.max_response_tokens, cfg.eval.temperature)
    results = {}
    for benchmark, problems in {"heldout": heldout, **(benchmarks or {})}.items():
        problems = problems[: cfg.eval.n_problems] if cfg.eval.n_problems else problems
        rollouts = score(runtime, roll_out(runtime, problems, cfg.eval.k, spec, desc=f"eval {label} {benchmark}"))
        table = f"eval-{label}" if benchmark == "heldout" else f"eval-{label}-{benchmark}"
        write_rollouts(ctx.run_id, ctx.run_dir, table, 0, rollouts)
        results[benchmark] = summarize_eval(ctx, label, benchmark, rollouts, cfg.eval.k)
    return mark_finished(ctx, f"eval-{label}", results["heldout"])
