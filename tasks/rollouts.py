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


@task(cache_policy=NO_CACHE)
def roll_out(runtime: Runtime, problems: list[Problem], samples: int, spec: RolloutSpec,
             desc: str) -> tuple[list[Trajectory], RolloutTimes]:
    pairs = [(p.problem_id, p.question) for p in problems]
    return run_rollouts(runtime.engine, runtime.tools, runtime.tokenizer, pairs, samples, spec, desc)


@task(cache_policy=NO_CACHE)
def score(runtime: Runtime, trajectories: list[Trajectory], problems: list[Problem]) -> dict:
    """Outcome reward per trajectory: the boxed answer in the <answer> block vs the label."""
    labels = {p.problem_id: p.answer for p in problems}
    responses = [t.response for t in trajectories]
    return {
        "rewards": runtime.verifier.score(responses, [labels[t.problem_id] for t in trajectories]),
        "predicted": [extract_answer(r) for r in responses],
        "answer_blocks": [count_answer_blocks(r) for r in responses],
    }


@task(cache_policy=NO_CACHE)
def write_rollouts(run_id: str, run_dir: Path, stage: str, step: int, trajectories: list[Trajectory],
                   problems: list[Problem], scored: dict, kept: list[bool] | None = None,
                   advantages: list[float] | None = None) -> Path:
    rows = rollout_rows(run_id, stage, step, trajectories, {p.problem_id: p.question for p in problems},
                        {p.problem_id: p.answer for p in problems}, scored["predicted"], scored["rewards"],
                        kept, advantages)
    return write_table(rows, ROLLOUTS, step_part(run_dir, "rollouts", stage, step))
