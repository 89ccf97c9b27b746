"""Prefect tasks of an RL step after scoring: select, update, sync, record."""

from __future__ import annotations

import random
import shutil
import time
from collections import Counter
from pathlib import Path

from prefect import task
from prefect.artifacts import create_table_artifact
from prefect.cache_policies import NO_CACHE

from tasks.config import RunConfig, StageConfig
from tasks.data.problems import Problem
from tasks.rl.batch import TrainingBatch, select_training_batch, solved_attempts, trajectory_score
from tasks.rollout.agent import RolloutSpec
from tasks.rollout.metrics import max_logprob_gap, rollout_metrics
from tasks.rollouts import Rollouts
from tasks.runtime import RunContext, Runtime
from tasks.store.tables import STEPS, read_table, step_part, write_table


def rollout_spec(cfg: RunConfig, max_turns: int, max_response_tokens: int, temperature: float) -> RolloutSpec:
    return RolloutSpec(max_turns, max_response_tokens, temperature, cfg.rollout.top_p,
                       cfg.rollout.tool_name, cfg.rollout.tool_response_chars, cfg.rollout.tool_spec)


@task(cache_policy=NO_CACHE)
def prepare_trainer(runtime: Runtime, total_steps: int, reset_optimizer: bool) -> None:
    """The policy trainer for a stage: kept from the previous stage unless a reset is asked."""
    runtime.policy_trainer(total_steps, reset_optimizer)


@task(cache_policy=NO_CACHE)
def sample_problems(problems: list[Problem], n: int, seed: int, stage: str, step: int) -> list[Problem]:
    """The step's problems: a draw that depends only on (seed, stage, step), so a rerun repeats it."""
    rng = random.Random(f"{seed}/{stage}/{step}")
    return rng.sample(problems, min(n, len(problems)))


@task(cache_policy=NO_CACHE)
def select_batch(cfg: RunConfig, rollouts: Rollouts, stage: str, step: int) -> TrainingBatch:
    scores = [trajectory_score(t, r, b)
              for t, r, b in zip(rollouts.trajectories, rollouts.rewards, rollouts.answer_blocks)]
    rng = random.Random(f"{cfg.seed}/{stage}/{step}/roc")
    return select_training_batch(rollouts.trajectories, scores, cfg.rl.group_size, cfg.rl.roc, rng)


@task(cache_policy=NO_CACHE)
def update_policy(runtime: Runtime, batch: TrainingBatch, cfg: RunConfig) -> dict:
    """One optimizer step on the kept trajectories; a batch with no signal skips the update."""
    if not batch.samples:
        return {"update_skipped": 1.0}
    started = time.perf_counter()
    metrics = runtime.trainer.rl_step(batch.samples, cfg.rl.loss, cfg.rollout.temperature)
    metrics["time_update_s"] = time.perf_counter() - started
    return metrics


@task(cache_policy=NO_CACHE)
def checkpoint(runtime: Runtime, ctx: RunContext, stage: str, step: int, keep: int) -> dict:
    """A DeepSpeed checkpoint of the step (weights, optimizer, schedule); older ones beyond
    `keep` are removed, so a long run does not fill the disk."""
    started = time.perf_counter()
    directory = ctx.run_dir / "checkpoints" / stage
    runtime.trainer.save_checkpoint(directory, tag=f"step-{step:05d}", client_state={"stage": stage, "step": step})
    for old in sorted(directory.glob("step-*"))[:-keep]:
        shutil.rmtree(old)
    return {"time_checkpoint_s": time.perf_counter() - started}


@task(cache_policy=NO_CACHE)
def export_policy(runtime: Runtime, ctx: RunContext, stage: str) -> Path:
    """The stage's final policy as a Hugging Face directory, runs/<id>/models/<stage>, next to
    models/base and models/sft: what a user loads, serves or evaluates later (rstar2-evaluate).
    Written beside and renamed into place, so a half-written export is never mistaken for one."""
    final = ctx.run_dir / "models" / stage
    partial = final.with_name(f".{stage}.partial")
    shutil.rmtree(partial, ignore_errors=True)
    runtime.trainer.save_pretrained(partial)
    runtime.tokenizer.save_pretrained(partial)
    shutil.rmtree(final, ignore_errors=True)
    partial.rename(final)
    return final


@task(cache_policy=NO_CACHE)
def sync_weights(runtime: Runtime, batch: TrainingBatch, probe_size: int = 2) -> dict:
    """Push the trainer's weights into the running engine (no restart), then compare the two
    views of the policy on a few kept trajectories: a stale or wrong sync shows up as a gap."""
    started = time.perf_counter()
    runtime.engine.load_weights(runtime.trainer.named_weights())
    metrics = {"time_sync_s": time.perf_counter() - started}
    probe = batch.samples[:probe_size]
    if probe:
        trainer_view = runtime.trainer.token_logprobs(probe)
        metrics["sync_logprob_gap"] = max(  # the worst engine: every one must have the new weights
            max_logprob_gap(engine_view, trainer_view)
            for engine_view in runtime.engine.prompt_logprobs([s.token_ids for s in probe])
        )
    return metrics


@task(cache_policy=NO_CACHE)
def keep_unsolved(ctx: RunContext, stage_run_id: str, rollouts: Rollouts, attempts: int) -> list[Problem]:
    """Difficulty filter: drop the problems the current policy solved in all its attempts; the
    histogram of solved attempts goes to MLflow (difficulty/solved_<j>_of_<k>) and Prefect."""
    solved = solved_attempts([t.problem_id for t in rollouts.trajectories], rollouts.rewards)
    problems = rollouts.problems
    hard = [p for p in problems if solved.get(p.problem_id, 0) < attempts]
    histogram = Counter(solved.get(p.problem_id, 0) for p in problems)
    counts = [{"solved": f"{j} of {attempts}", "problems": histogram.get(j, 0)} for j in range(attempts + 1)]
    metrics = {f"difficulty/solved_{j}_of_{attempts}": histogram.get(j, 0) for j in range(attempts + 1)}
    ctx.tracker.log_metrics(stage_run_id, {**metrics, "difficulty/kept": len(hard)})
    create_table_artifact(counts, key="difficulty-filter", description="Problems by attempts solved")
    print(f"difficulty filter: kept {len(hard)} of {len(problems)} problems (solved < {attempts}/{attempts}); "
          f"solved-attempts histogram {dict(sorted(histogram.items()))}")
    return hard


def _log_step_once(ctx: RunContext, stage_run_id: str, step: int, metrics: dict) -> None:
    tracker = ctx.tracker
    if step not in tracker.metric_steps(stage_run_id, "reward_mean"):
        tracker.log_metrics(stage_run_id, metrics, step)


@task(cache_policy=NO_CACHE)
def resume_stage(runtime: Runtime, ctx: RunContext, cfg: RunConfig, stage: StageConfig, stage_run_id: str) -> int:
    """The first step of `stage` still to run. Steps with a row in the steps table are done: the
    trainer continues from the last one's checkpoint (weights, optimizer, schedule), its metrics
    reach MLflow if the interruption fell between the table and MLflow, and the engines get its
    weights. A stage not started yet, after earlier stages finished by an earlier attempt, starts
    from the previous stage's last checkpoint."""
    done = [k for k in range(stage.steps) if step_part(ctx.run_dir, "steps", stage.name, k).exists()]
    names = [s.name for s in cfg.rl.stages]
    previous = names[names.index(stage.name) - 1] if names.index(stage.name) > 0 else None
    trained_here, runtime.stages_trained = set(runtime.stages_trained), runtime.stages_trained | {stage.name}
    if done:
        last = max(done)
        runtime.trainer.load_checkpoint(ctx.run_dir / "checkpoints" / stage.name, tag=f"step-{last:05d}")
        rows = read_table(step_part(ctx.run_dir, "steps", stage.name, last))
        _log_step_once(ctx, stage_run_id, last, {r["metric"]: r["value"] for r in rows})
    elif previous is not None and previous not in trained_here:
        runtime.trainer.load_checkpoint(ctx.run_dir / "checkpoints" / previous, weights_only=stage.reset_optimizer)
    else:
        return 0
    runtime.engine.load_weights(runtime.trainer.named_weights())
    first = max(done) + 1 if done else 0
    print(f"{stage.name}: resuming at step {first} of {stage.steps}")
    return first


@task(cache_policy=NO_CACHE)
def record_step(ctx: RunContext, stage_run_id: str, stage: StageConfig, step: int, rollouts: Rollouts,
                batch: TrainingBatch, update: dict) -> dict:
    """All of a step's metrics, to MLflow and to the steps table."""
    times = rollouts.times
    metrics = rollout_metrics(rollouts.trajectories, rollouts.rewards)
    metrics.update(batch.roc.metrics(prefix="roc/"))
    metrics.update({"kept": sum(batch.kept), "dropped": len(batch.kept) - sum(batch.kept),
                    "time_rollout_s": times.total_s, "time_tool_wait_s": times.tool_wait_s,
                    "time_tool_exec_s": times.tool_exec_s, "engine_idle_fraction": times.engine_idle_fraction,
                    "engine_preemptions": times.preemptions, "kv_reserve_tokens": times.kv_reserve_tokens})
    metrics.update(update)
    rows = [{"run_id": ctx.run_id, "stage": stage.name, "step": step, "metric": k, "value": float(v)}
            for k, v in metrics.items()]
    # The table row marks the step done (see resume_stage); MLflow follows, at most once per step.
    write_table(rows, STEPS, step_part(ctx.run_dir, "steps", stage.name, step))
    _log_step_once(ctx, stage_run_id, step, metrics)
    print(f"[{stage.name} step {step}] reward {metrics['reward_mean']:.3f} kept {metrics['kept']} "
          f"tool calls {metrics['tool_calls']} errors {metrics['tool_errors']} "
          f"rollout {times.total_s:.1f}s update {update.get('time_update_s', 0.0):.1f}s")
    return metrics
