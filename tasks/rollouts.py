"""Prefect tasks shared by RL steps and evaluation: roll out, score, write rows."""

from __future__ import annotations

from pathlib import Path

from prefect import task
from prefect.cache_policies import NO_CACHE

from tasks.data.problems import Problem
from tasks.reward.verify import count_answer_blocks, extract_answer
from tasks.rollout.agent import RolloutSpec, RolloutTimes, Trajectory, run_rollouts
from tasks.runtime import Runtime
from tasks.store.tables import ROLLOUTS, rollout_rows, step_part, write_table


class Rollouts:
    """A batch of trajectories for some problems, and their scores once `score` has run.

    A plain class on purpose: Prefect walks the lists, dicts and dataclasses passed to a task
    looking for upstream futures, which cost ~1.2 s per task call at 256 trajectories; an object
    of a plain class is passed through untouched.
    """

    def __init__(self, problems: list[Problem], trajectories: list[Trajectory], times: RolloutTimes):
        self.problems, self.trajectories, self.times = problems, trajectories, times
        self.rewards: list[float] = []
        self.predicted: list[str | None] = []
        self.answer_blocks: list[int] = []


@task(cache_policy=NO_CACHE)
def roll_out(runtime: Runtime, problems: list[Problem], samples: int, spec: RolloutSpec, desc: str) -> Rollouts:
    pairs = [(p.problem_id, p.question) for p in problems]
    engine = runtime.cfg.engine
    trajectories, times = run_rollouts(runtime.engine, runtime.tools, runtime.tokenizer, pairs, samples, spec, desc,
                                      engine.scheduler, engine.kv_reserve, runtime.rollout_sizes, engine.kv_headroom)
    runtime.rollout_sizes = [len(t.prompt_ids) + len(t.response_ids) for t in trajectories]
    return Rollouts(problems, trajectories, times)


@task(cache_policy=NO_CACHE)
def serve_policy(runtime: Runtime, model_dir: Path) -> None:
    """Load a model directory's weights into the running engine (no restart)."""
    runtime.load_policy(model_dir)


@task(cache_policy=NO_CACHE)
def score(runtime: Runtime, rollouts: Rollouts) -> Rollouts:
    """Outcome reward per trajectory (the boxed answer in the <answer> block vs the label),
    set on the rollouts, which are returned."""
    labels = {p.problem_id: p.answer for p in rollouts.problems}
    responses = [t.response for t in rollouts.trajectories]
    rollouts.rewards = runtime.verifier.score(responses, [labels[t.problem_id] for t in rollouts.trajectories])
    rollouts.predicted = [extract_answer(r) for r in responses]
    rollouts.answer_blocks = [count_answer_blocks(r) for r in responses]
    return rollouts


@task(cache_policy=NO_CACHE)
def write_rollouts(run_id: str, run_dir: Path, stage: str, step: int, rollouts: Rollouts,
                   kept: list[bool] | None = None, advantages: list[float] | None = None) -> Path:
    problems = rollouts.problems
    rows = rollout_rows(run_id, stage, step, rollouts.trajectories, {p.problem_id: p.question for p in problems},
                        {p.problem_id: p.answer for p in problems}, rollouts.predicted, rollouts.rewards,
                        kept, advantages)
    return write_table(rows, ROLLOUTS, step_part(run_dir, "rollouts", stage, step))
