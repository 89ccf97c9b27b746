"""An RL stage of GRPO-RoC; each step is a subflow (rollouts -> reward -> RoC -> update -> sync)."""

from prefect import flow

from flows.once import run_once
from tasks.config import RunConfig, StageConfig
from tasks.curate import select_problems
from tasks.grpo import (
    begin_step,
    checkpoint,
    export_policy,
    finish_rolling_ahead,
    keep_unsolved,
    prepare_trainer,
    record_step,
    rejoin_engines,
    resume_stage,
    sample_problems,
    select_batch,
    start_rolling_ahead,
    sync_weights,
    update_policy,
)
from tasks.policy import roll_out, roll_out_step, score, write_rollouts
from tasks.records import Problem, RunContext
from tasks.report import publish_stage_summary, track_progress
from tasks.runtime import Runtime


@flow(name="rl-step", log_prints=True, validate_parameters=False)
def rl_step(
    cfg: RunConfig,
    ctx: RunContext,
    runtime: Runtime,
    stage: StageConfig,
    step: int,
    problems: list[Problem],
    stage_run: str,
) -> dict:
    clock = begin_step(runtime)
    rejoined = rejoin_engines(runtime)
    batch_problems = sample_problems(problems, stage.problems_per_step, cfg.seed, stage.name, step)
    rollouts = roll_out_step(runtime, ctx, cfg, stage, step, batch_problems)
    with start_rolling_ahead(runtime, ctx, cfg, stage, step, problems) as ahead:  # rl.async: the next steps
        rollouts = score(runtime, rollouts)
        batch = select_batch(cfg, rollouts, stage.name, step)
        write_rollouts(ctx.run_id, ctx.run_dir, stage.name, step, rollouts, batch.kept, batch.advantages, step)
        update = update_policy(runtime, batch, cfg, stage)
        update |= checkpoint(runtime, ctx, stage.name, step, cfg.rl.checkpoint_keep)
        update |= finish_rolling_ahead(ahead)
    update |= sync_weights(runtime, batch, rejoined)
    return record_step(ctx, stage_run, stage, step, rollouts, batch, update, clock, runtime)


def hard_problems(
    ctx: RunContext, runtime: Runtime, stage: StageConfig, problems: list[Problem], stage_run: str
) -> list[Problem]:
    """The difficulty filter of a hard_only stage: the problems the policy does not yet solve in
    all of its attempts."""

    def attempt(_) -> list[str]:
        attempts = score(runtime, roll_out(runtime, problems, stage.difficulty_attempts, stage, desc="difficulty"))
        return keep_unsolved(ctx, stage_run, attempts, stage.difficulty_attempts)

    return select_problems(problems, run_once(ctx, f"difficulty-{stage.name}", attempt))


@flow(name="rl-stage", log_prints=True, validate_parameters=False)
def rl_stage(
    cfg: RunConfig, ctx: RunContext, runtime: Runtime, stage: StageConfig, problems: list[Problem], total_steps: int
) -> int:
    def train(stage_run: str) -> int:
        prepare_trainer(runtime, total_steps, stage.reset_optimizer)
        first = resume_stage(runtime, ctx, cfg, stage, stage_run)
        stage_problems = hard_problems(ctx, runtime, stage, problems, stage_run) if stage.hard_only else problems
        progress = track_progress(None, stage.name, first, stage.steps)
        for step in range(first, stage.steps):
            rl_step(cfg, ctx, runtime, stage, step, stage_problems, stage_run)
            track_progress(progress, stage.name, step + 1, stage.steps)
        export_policy(runtime, ctx, stage.name)
        publish_stage_summary(ctx, stage.name)
        return stage.steps

    return run_once(ctx, f"rl-{stage.name}", train, mlflow_stage=stage.name, params=stage.model_dump(mode="json"))
