"""Evaluate: avg@k pass@1 of the current policy on the held-out split and each benchmark; and the
same for a saved policy of an earlier run (the `rstar2-evaluate` deployment)."""

from typing import Any

from prefect import flow

from flows.once import run_once
from tasks.config import RunConfig
from tasks.curate import load_benchmarks, load_problems
from tasks.policy import roll_out, score, write_rollouts
from tasks.records import Problem, RunContext
from tasks.report import end_run, record_placement, reopen_run, summarize_eval
from tasks.resume import finished, saved_policy
from tasks.runtime import Runtime


@flow(name="evaluate", log_prints=True, validate_parameters=False)
def evaluate(
    cfg: RunConfig,
    ctx: RunContext,
    runtime: Runtime,
    label: str,
    heldout: list[Problem],
    benchmarks: dict[str, list[Problem]] | None = None,
) -> dict:
    """Returns the held-out split's metrics; every benchmark's go to MLflow and the tables."""

    def work(_) -> dict:
        results = {}
        for benchmark, problems in {"heldout": heldout, **(benchmarks or {})}.items():
            problems = problems[: cfg.eval.n_problems] if cfg.eval.n_problems else problems
            rollouts = score(
                runtime, roll_out(runtime, problems, cfg.eval.k, cfg.eval, desc=f"eval {label} {benchmark}")
            )
            table = f"eval-{label}" if benchmark == "heldout" else f"eval-{label}-{benchmark}"
            write_rollouts(ctx.run_id, ctx.run_dir, table, 0, rollouts)
            results[benchmark] = summarize_eval(ctx, label, benchmark, rollouts, cfg.eval.k)
        return results["heldout"]

    return run_once(ctx, f"eval-{label}", work)


@flow(name="rstar2-evaluate", log_prints=True)
def evaluate_checkpoint(
    run_id: str,
    checkpoint: str = "sft",
    label: str | None = None,
    eval_overrides: dict[str, Any] | None = None,
    output_dir: str = "outputs",
) -> dict:
    """Evaluate a saved policy of an earlier run (`base`, `sft` or an RL stage's name) on that run's
    held-out split and benchmarks, with its eval settings changed by `eval_overrides` (e.g.
    {"k": 64, "temperature": 1.0}). Results join the run's evaluations table and MLflow run as
    checkpoint `label` (default: the checkpoint's name; a label already evaluated is not redone)."""
    cfg, ctx = reopen_run(output_dir, run_id, eval_overrides)
    policy, splits = saved_policy(ctx, checkpoint), finished(ctx, "curate")
    try:
        with Runtime(cfg, policy, ctx.run_dir) as runtime:
            record_placement(ctx, runtime.where)
            result = evaluate(
                cfg, ctx, runtime, label or checkpoint, load_problems(splits["heldout"]), load_benchmarks(cfg.data)
            )
    finally:
        end_run(ctx, ctx.mlflow_run_id)
    return result
