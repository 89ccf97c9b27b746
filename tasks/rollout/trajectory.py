"""The records of a rollout: what one may spend, what it produced, and what a batch of them cost.

Light on purpose (no torch, no engine, no sandbox client): the pure RL code, the metrics and the
tables import these types without loading the rollout loop.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from tasks.config import RolloutBudget, RolloutConfig
from tasks.data.problems import Problem
from tasks.sandbox.status import ToolStatus


@dataclass(frozen=True)
class RolloutSpec:
    max_turns: int
    max_response_tokens: int
    temperature: float
    top_p: float
    tool_name: str
    tool_response_chars: int
    tool_spec: str = "schema"


def rollout_spec(rollout: RolloutConfig, budget: RolloutBudget) -> RolloutSpec:
    """The sampling settings of the run's rollouts within one budget (a stage's, the consensus
    filter's or evaluation's)."""
    return RolloutSpec(
        budget.max_turns,
        budget.max_response_tokens,
        budget.temperature,
        rollout.top_p,
        rollout.tool_name,
        rollout.tool_response_chars,
        rollout.tool_spec,
    )


@dataclass
class ToolCallRecord:
    turn: int
    status: ToolStatus
    latency_s: float
    code: str


@dataclass
class Trajectory:
    problem_id: str
    sample: int
    prompt_ids: list[int]
    response_ids: list[int] = field(default_factory=list)
    loss_mask: list[int] = field(default_factory=list)  # 1 on generated tokens, 0 on tool tokens
    response: str = ""  # decoded response, tool turns included
    turns: int = 0  # assistant turns
    tool_calls: list[ToolCallRecord] = field(default_factory=list)
    stop_reason: str = ""  # answer | no_answer | max_turns | budget

    def extend(self, ids: list[int], text: str, trainable: bool) -> None:
        self.response_ids += ids
        self.loss_mask += [int(trainable)] * len(ids)
        self.response += text


@dataclass
class RolloutTimes:
    total_s: float = 0.0
    tool_wait_s: float = 0.0  # wall time no engine had work, waiting for tool results
    tool_exec_s: float = 0.0  # summed sandbox latency of all calls
    engine_idle_fraction: float = 0.0  # of the engines' time during the batch, spent idle
    preemptions: int = 0  # rollouts evicted from an engine's KV cache (recomputed later)
    kv_reserve_tokens: int = 0  # what the KV-aware scheduler set aside per rollout
    requeued_rollouts: int = 0  # moved to another engine when theirs died
    engine_deaths: int = 0  # engines found dead during the batch
    sandbox_retries: int = 0  # tool-call attempts sent again after a replica failed to answer


class Rollouts:
    """A batch of trajectories for some problems, and their scores once scored.

    A plain class on purpose: Prefect walks the lists, dicts and dataclasses passed to a task
    looking for upstream futures, which cost ~1.2 s per task call at 256 trajectories; an object
    of a plain class is passed through untouched.
    """

    def __init__(self, problems: list[Problem], trajectories: list[Trajectory], times: RolloutTimes):
        self.problems, self.trajectories, self.times = problems, trajectories, times
        self.rewards: list[float] = []
        self.predicted: list[str | None] = []
        self.answer_blocks: list[int] = []
