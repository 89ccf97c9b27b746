"""An RL stage of GRPO-RoC; each step is a subflow (rollouts -> reward -> RoC -> update -> sync)."""

from prefect import flow

from tasks.config import RunConfig, StageConfig
from tasks.curate import problem_ids, select_problems
from tasks.data.problems import Problem
from tasks.report import end_run, publish_stage_summary, start_stage_run, track_progress
from tasks.resume import finished, mark_finished
from tasks.rl_update import (
    checkpoint,
    export_policy,
    keep_unsolved,
    prepare_trainer,
    record_step,
    resume_stage,
    rollout_spec,
    sample_problems,
    select_batch,
    sync_weights,
    update_policy,
)
from tasks.rollouts import roll_out, score, write_rollouts
from tasks.runtime import RunContext, Runtime


@flow(name="rl-step", log_prints=True, validate_parameters=False)
def rl_step(cfg: RunConfig, ctx: RunContext, runtime: Runtime, stage: StageConfig, step: int,
            problems: list[Problem], stage_run: str) -> dict:
    batch_problems = sample_problems(problems, stage.problems_per_step, cfg.seed, stage.name, step)
    spec = rollout_spec(cfg, stage.max_turns, stage.max_response_tokens, cfg.rollout.temperature)
    rollouts = roll_out(runtime, batch_problems, cfg.rl.rollouts_per_problem, spec, desc=f"{stage.name} step {step}")
    rollouts = score(runtime, rollouts)
    batch = select_batch(cfg, rollouts, stage.name, step)
    write_rollouts(ctx.run_id, ctx.run_dir, stage.name, step, rollouts, batch.kept, batch.advantages)
    update = update_policy(runtime, batch, cfg)
    update |= checkpoint(runtime, ctx, stage.name, step, cfg.rl.checkpoint_keep)
    update |= sync_weights(runtime, batch)
    return record_step(ctx, stage_run, stage, step, rollouts, batch, update)


@flow(name="rl-stage", log_prints=True, validate_parameters=False)
def rl_stage(cfg: RunConfig, ctx: RunContext, runtime: Runtime, stage: StageConfig,
             problems: list[Problem], total_steps: int) -> int:
    if (done := finished(ctx, f"rl-{stage.name}")) is not None:
        return done
    stage_run = start_stage_run(ctx, stage.name, stage.model_dump(mode="json"))
    prepare_trainer(runtime, total_steps, stage.reset_optimizer)
    first = resume_stage(runtime, ctx, cfg, stage, stage_run)
    if stage.hard_only:
        if (hard := finished(ctx, f"difficulty-{stage.name}")) is None:
            spec = rollout_spec(cfg, stage.max_turns, stage.max_response_tokens, cfg.rollout.temperature)
            attempts = score(runtime, roll_out(runtime, problems, stage.difficulty_attempts, spec, desc="difficulty"))
            hard = mark_finished(ctx, f"difficulty-{stage.name}",
                                 problem_ids(keep_unsolved(ctx, stage_run, attempts, stage.difficulty_attempts)))
        problems = select_problems(problems, hard)
    progress = track_progress(None, stage.name, first, stage.steps)
    for step in range(first, stage.steps):
        rl_step(cfg, ctx, runtime, stage, step, problems, stage_run)
        track_progress(progress, stage.name, step + 1, stage.steps)
    export_policy(runtime, ctx, stage.name)
    publish_stage_summary(ctx, stage.name)
    end_run(ctx, stage_run)
    return mark_finished(ctx, f"rl-{stage.name}", stage.steps)
