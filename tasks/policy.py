"""Prefect tasks that run the current policy: serve a model's weights, roll out problems on the
engines, score the rollouts, write them to the rollouts table (library: tasks/rollout/,
tasks/reward/verify.py, tasks/store/tables.py). Shared by RL steps, filters and evaluation."""

from __future__ import annotations

from pathlib import Path

from prefect import task
from prefect.cache_policies import NO_CACHE

from tasks.config import RolloutBudget, RunConfig, StageConfig
from tasks.records import Problem, Rollouts, RunContext
from tasks.reward.verify import score_rollouts
from tasks.rollout.agent import run_rollouts
from tasks.runtime import Runtime
from tasks.runtime.steps import draw_step
from tasks.store.tables import ROLLOUTS, rollout_rows, step_part, write_table


@task(cache_policy=NO_CACHE)
def serve_policy(runtime: Runtime, model_dir: Path) -> None:
    """Load a model directory's weights into the running engines (no restart)."""
    runtime.load_policy(model_dir)


@task(cache_policy=NO_CACHE)
def roll_out(runtime: Runtime, problems: list[Problem], samples: int, budget: RolloutBudget, desc: str) -> Rollouts:
    """`samples` trajectories per problem within `budget`, on the engines the scheduler picks."""
    pairs = [(p.problem_id, p.question) for p in problems]
    spec = runtime.cfg.rollout.spec(budget)
    trajectories, times = run_rollouts(runtime.engines, runtime.tools, runtime.tokenizer, pairs, samples, spec, desc)
    return Rollouts(problems, trajectories, times)


@task(cache_policy=NO_CACHE)
def roll_out_step(
    runtime: Runtime, ctx: RunContext, cfg: RunConfig, stage: StageConfig, step: int, problems: list[Problem]
) -> Rollouts:
    """An RL step's rollouts, on the engines the scheduler picks. Rollouts finished before (drawn
    ahead of the step under rl.async, or before the run was interrupted) are kept when fresh
    enough; the rest are drawn now by the step's own policy version."""
    return draw_step(runtime, ctx, cfg, stage, step, problems, version=step)


@task(cache_policy=NO_CACHE)
def score(runtime: Runtime, rollouts: Rollouts) -> Rollouts:
    """Outcome reward per trajectory (the boxed answer in the <answer> block vs the label)."""
    return score_rollouts(runtime.verifier, rollouts)


@task(cache_policy=NO_CACHE)
def write_rollouts(
    run_id: str,
    run_dir: Path,
    stage: str,
    step: int,
    rollouts: Rollouts,
    kept: list[bool] | None = None,
    advantages: list[float] | None = None,
    trained_version: int | None = None,
) -> Path:
    """The rollouts' rows, as one part per (stage, step); `trained_version`: the policy version
    an RL step trained them at (each row also records the version that drew it)."""
    rows = rollout_rows(run_id, stage, step, rollouts, kept, advantages, trained_version)
    return write_table(rows, ROLLOUTS, step_part(run_dir, "rollouts", stage, step))
