"""Prefect tasks of an RL stage after the rollouts are scored: GRPO-RoC selection, the policy
update, checkpoint and weight sync, the step's record, the difficulty filter and resuming
(library: tasks/rl/batch.py, tasks/runtime/, tasks/store/run_folder.py)."""

from __future__ import annotations

import time
from pathlib import Path

from prefect import task
from prefect.artifacts import create_table_artifact
from prefect.cache_policies import NO_CACHE

from tasks.config import RunConfig, StageConfig
from tasks.records import Problem, Rollouts, RunContext
from tasks.rl import batch as rl_batch
from tasks.rl.batch import TrainingBatch
from tasks.runtime import Runtime
from tasks.runtime.steps import RollingAhead, StepClock
from tasks.store import inflight
from tasks.store.run_folder import checkpoint_tag, prune_checkpoints, steps_done
from tasks.store.tables import STEPS, read_table, step_part, write_table
from tasks.tracking.mlflow_log import Tracker


@task(cache_policy=NO_CACHE)
def prepare_trainer(runtime: Runtime, total_steps: int, reset_optimizer: bool) -> None:
    """The policy trainer for a stage: kept from the previous stage unless a reset is asked."""
    runtime.policy_trainer(total_steps, reset_optimizer)


@task(cache_policy=NO_CACHE)
def sample_problems(problems: list[Problem], n: int, seed: int, stage: str, step: int) -> list[Problem]:
    """The step's problems: a draw that depends only on (seed, stage, step), so a rerun repeats it."""
    return rl_batch.step_problems(problems, n, seed, stage, step)


@task(cache_policy=NO_CACHE)
def select_batch(cfg: RunConfig, rollouts: Rollouts, stage: str, step: int) -> TrainingBatch:
    return rl_batch.training_batch(rollouts, cfg.rl.group_size, cfg.rl.roc, cfg.seed, stage, step)


@task(cache_policy=NO_CACHE)
def begin_step(runtime: Runtime) -> StepClock:
    return StepClock.start(runtime)


@task(cache_policy=NO_CACHE)
def start_rolling_ahead(
    runtime: Runtime, ctx: RunContext, cfg: RunConfig, stage: StageConfig, step: int, problems: list[Problem]
) -> RollingAhead:
    """Under rl.async, the engines start drawing the next steps' rollouts of `problems` on the
    weights they hold as soon as this step's are drawn, while the step is scored, selected,
    written, updated and checkpointed. Used as a context: if that work fails, the drawing stops
    before the error leaves the step."""
    return RollingAhead(runtime, ctx, cfg, stage, step, problems)


@task(cache_policy=NO_CACHE)
def finish_rolling_ahead(ahead: RollingAhead) -> dict:
    """The step's update and checkpoint are done: no more rollouts start, those in flight finish;
    what they drew."""
    return ahead.finish()


@task(cache_policy=NO_CACHE)
def update_policy(runtime: Runtime, batch: TrainingBatch, cfg: RunConfig, stage: StageConfig) -> dict:
    """One optimizer step on the kept trajectories; a batch with no signal skips the update."""
    if not batch.samples:
        return {"update_skipped": 1.0}
    started = time.perf_counter()
    metrics = runtime.trainer.rl_step(batch.samples, cfg.rl.loss, stage.temperature)
    return metrics | {"time_update_s": time.perf_counter() - started}


@task(cache_policy=NO_CACHE)
def checkpoint(runtime: Runtime, ctx: RunContext, stage: str, step: int, keep: int) -> dict:
    """A DeepSpeed checkpoint of the step (weights, optimizer, schedule); only the newest `keep`
    stay."""
    started = time.perf_counter()
    runtime.trainer.save_checkpoint(ctx.checkpoints(stage), checkpoint_tag(step), {"stage": stage, "step": step})
    prune_checkpoints(ctx.checkpoints(stage), keep)
    return {"time_checkpoint_s": time.perf_counter() - started}


@task(cache_policy=NO_CACHE)
def rejoin_engines(runtime: Runtime) -> int:
    """Before a step's rollouts: engines Ray has restarted since the last push get the current
    weights and take rollouts again in this step; how many rejoined."""
    return runtime.rejoin_restarted()


@task(cache_policy=NO_CACHE)
def sync_weights(runtime: Runtime, batch: TrainingBatch, rejoined: int = 0, probe_size: int = 2) -> dict:
    """Push the trainer's weights into the running engines, and into any Ray has restarted (they
    serve again from the next step); a stale or wrong sync shows up as a log-prob gap on a few
    kept trajectories. `engine_restarts` counts the step's rejoined engines, `rejoined` of them
    before its rollouts."""
    started, restarts = time.perf_counter(), runtime.engines.restarts
    gap = runtime.sync_weights(batch.samples[:probe_size])
    metrics = {
        "time_sync_s": time.perf_counter() - started,
        "engine_restarts": rejoined + runtime.engines.restarts - restarts,
    }
    return metrics | ({} if gap is None else {"sync_logprob_gap": gap})


@task(cache_policy=NO_CACHE)
def export_policy(runtime: Runtime, ctx: RunContext, stage: str) -> Path:
    """The stage's final policy as a Hugging Face directory, runs/<id>/models/<stage>, next to
    models/base and models/sft: what a user loads, serves or evaluates later (rstar2 evaluate)."""
    return runtime.export_policy(ctx.policy_dir(stage))


@task(cache_policy=NO_CACHE)
def keep_unsolved(ctx: RunContext, stage_run_id: str, attempts: Rollouts, k: int) -> list[str]:
    """Difficulty filter: the ids of the problems the policy did not solve in all k attempts; the
    histogram of solved attempts goes to MLflow (difficulty/solved_<j>_of_<k>) and Prefect."""
    hard, histogram = rl_batch.keep_unsolved(attempts, k)
    metrics = {f"difficulty/solved_{j}_of_{k}": n for j, n in histogram.items()}
    Tracker(ctx.output_dir).log_metrics(stage_run_id, {**metrics, "difficulty/kept": len(hard)})
    create_table_artifact(
        [{"solved": f"{j} of {k}", "problems": n} for j, n in histogram.items()],
        key="difficulty-filter",
        description="Problems by attempts solved",
    )
    print(
        f"difficulty filter: kept {len(hard)} of {len(attempts.problems)} problems (solved < {k}/{k}); "
        f"solved-attempts histogram { {j: n for j, n in histogram.items() if n} }"
    )
    return [p.problem_id for p in hard]


@task(cache_policy=NO_CACHE)
def resume_stage(runtime: Runtime, ctx: RunContext, cfg: RunConfig, stage: StageConfig, stage_run_id: str) -> int:
    """The first step of `stage` still to run. Steps with a row in the steps table are done: the
    trainer continues from the last one's checkpoint (weights, optimizer, schedule), its metrics
    reach MLflow if the interruption fell between the table and MLflow, and the engines get its
    weights. A stage not started yet, after earlier stages finished by an earlier attempt, starts
    from the previous stage's last checkpoint."""
    done = steps_done(ctx, stage.name, stage.steps)
    for step in done:  # recorded, its rollouts part written: a kill came before their folder went
        inflight.forget(inflight.step_folder(ctx.run_dir, stage.name, step))
    previous = cfg.rl.previous_stage(stage.name)
    trained_here = runtime.begin_stage(stage.name)
    if done:
        runtime.restore(ctx.checkpoints(stage.name), checkpoint_tag(max(done)))
        rows = read_table(step_part(ctx.run_dir, "steps", stage.name, max(done)))
        Tracker(ctx.output_dir).log_step_once(stage_run_id, {r["metric"]: r["value"] for r in rows}, max(done))
    elif previous is not None and previous not in trained_here:
        runtime.restore(ctx.checkpoints(previous), weights_only=stage.reset_optimizer)
    else:
        return 0
    first = max(done) + 1 if done else 0
    print(f"{stage.name}: resuming at step {first} of {stage.steps}")
    return first


@task(cache_policy=NO_CACHE)
def record_step(
    ctx: RunContext,
    stage_run_id: str,
    stage: StageConfig,
    step: int,
    rollouts: Rollouts,
    batch: TrainingBatch,
    update: dict,
    clock: StepClock,
    runtime: Runtime,
) -> dict:
    """All of a step's metrics, to the steps table and then MLflow; the step's in-flight
    rollouts go, as its rollouts part holds them. The idle fractions cover the whole step
    (rollouts, update, checkpoint, sync): the trainer is busy updating and checkpointing, the
    engines while they generate."""
    trainer_busy = update.get("time_update_s", 0.0) + update.get("time_checkpoint_s", 0.0)
    update = update | clock.idle(runtime, trainer_busy)
    metrics = rl_batch.step_metrics(rollouts, batch, update, trained_version=step)
    rows = [
        {"run_id": ctx.run_id, "stage": stage.name, "step": step, "metric": k, "value": float(v)}
        for k, v in metrics.items()
    ]
    # The table row marks the step done (see resume_stage); MLflow follows, at most once per step.
    write_table(rows, STEPS, step_part(ctx.run_dir, "steps", stage.name, step))
    inflight.forget(inflight.step_folder(ctx.run_dir, stage.name, step))
    Tracker(ctx.output_dir).log_step_once(stage_run_id, metrics, step)
    print(
        f"[{stage.name} step {step}] reward {metrics['reward_mean']:.3f} kept {metrics['kept']} "
        f"tool calls {metrics['tool_calls']} errors {metrics['tool_errors']} "
        f"rollout {rollouts.times.total_s:.1f}s update {update.get('time_update_s', 0.0):.1f}s "
        f"step {metrics['time_step_s']:.1f}s idle trainer {metrics['idle/trainer']:.2f} "
        f"engines {metrics['idle/engines']:.2f} "
        f"staleness {metrics['staleness/mean']:.2f}"
    )
    return metrics
