"""The whole recipe as one flow: curate -> base model -> SFT -> RL stages -> evaluate.

Each RL stage is evaluated on the held-out split before and after, so the summary shows what
every stage bought.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from prefect import flow

from flows.curate import consensus, curate
from flows.evaluate import evaluate
from flows.preflight import check_run
from flows.rl import rl_stage
from flows.sft import base_model, sft
from tasks.config import RunConfig, default_config_path, load_config
from tasks.curate import load_benchmarks, load_problems
from tasks.policy import serve_policy
from tasks.records import RunContext
from tasks.report import (
    end_run,
    publish_summary,
    record_placement,
    stage_row,
    start_pipeline_run,
    start_stopwatch,
)
from tasks.resume import stages_to_run
from tasks.runtime import Runtime
from tasks.summary.run_card import Stopwatch


@flow(name="rstar2-pipeline", log_prints=True)
def pipeline(
    config: str = str(default_config_path()),
    run_id: str | None = None,
    overrides: dict[str, Any] | None = None,
    stages: list[str] | None = None,
) -> dict:
    """`stages`: the RL stages to run (default: all), e.g. one stage of an earlier run, given its
    run id; the stages before it must have finished in that run."""
    cfg = load_config(config, overrides)
    check_run(cfg)  # bad input stops here, before the run folder or its MLflow run exists
    ctx = start_pipeline_run(cfg, config, run_id)
    clock = start_stopwatch(ctx)
    try:
        splits = curate(cfg.data, ctx)
        rows = [stage_row("curate", None, None, None, clock)]
        base_dir, base_steps = base_model(cfg, ctx, splits["train"])
        attempts = on_cluster.with_options(retries=cfg.cluster.flow_retries, retry_delay_seconds=5)
        rows += attempts(cfg, ctx, splits, base_dir, base_steps, clock, stages)
        publish_summary(ctx, rows, clock.total())
    except BaseException:
        end_run(ctx, ctx.mlflow_run_id, ok=False)
        raise
    end_run(ctx, ctx.mlflow_run_id)
    return {"run_id": ctx.run_id, "run_dir": str(ctx.run_dir), "stages": rows}


@flow(name="on-cluster", log_prints=True, validate_parameters=False)
def on_cluster(
    cfg: RunConfig,
    ctx: RunContext,
    splits: dict,
    base_dir: Path,
    base_steps: int,
    clock: Stopwatch,
    stages: list[str] | None,
) -> list[dict]:
    """SFT, the RL stages and the evaluations, on the cluster's actors. An attempt that fails (a
    trainer rank died, a node is gone for good) is retried by Prefect (cluster.flow_retries) with
    new actors: what an earlier attempt finished is not done again, and an RL stage goes on from
    its last step's checkpoint."""
    train, heldout = load_problems(splits["train"]), load_problems(splits["heldout"])
    benchmarks = load_benchmarks(cfg.data)
    rows = []
    with Runtime(cfg, base_dir, ctx.run_dir) as runtime:
        record_placement(ctx, runtime.where)
        before = evaluate(cfg, ctx, runtime, "base", heldout, benchmarks) if cfg.eval.base else None
        rows.append(stage_row("base model", base_steps, None, before, clock))
        sft_dir, sft_steps = sft(cfg, ctx, runtime, base_dir)
        serve_policy(runtime, sft_dir)
        after = evaluate(cfg, ctx, runtime, "sft", heldout, benchmarks)
        rows.append(stage_row("sft", sft_steps, before, after, clock))
        if cfg.data.consensus:
            train = consensus(cfg, ctx, runtime, train)
        for stage in stages_to_run(cfg, ctx, stages):
            before = after
            steps = rl_stage(cfg, ctx, runtime, stage, train, cfg.rl.total_steps)
            after = evaluate(cfg, ctx, runtime, stage.name, heldout, benchmarks)
            rows.append(stage_row(stage.name, steps, before, after, clock))
    return rows
