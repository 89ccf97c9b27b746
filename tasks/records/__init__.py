"""The plain record types every layer of the library shares: problems, tool-call outcomes,
rollouts and their trajectories, training samples, and a run's context.

The bottom of the house: this module imports nothing of the project and no heavy dependency, so
a pure algorithm, a table writer or a test reads these types without loading torch, an engine
or the sandbox client. RoC's penalty counts failed tool calls from `ToolStatus.is_failure`, never
from the response text: the release's "the response contains 'error'" test misses timeouts and
flags stdout that merely mentions the word.
"""

from __future__ import annotations

import enum
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any


@dataclass(frozen=True)
class Problem:
    problem_id: str
    kind: str
    level: int
    question: str
    answer: str  # an integer, as text
    solution_code: str  # a program whose stdout is the answer

    def to_row(self) -> dict:
        return asdict(self)


class ToolStatus(str, enum.Enum):
    OK = "ok"
    ERROR = "error"  # non-zero exit, usually an uncaught exception or a syntax error
    TIMEOUT = "timeout"  # wall-clock or CPU limit
    MEMORY = "memory"  # MemoryError under the address-space limit
    OUTPUT_LIMIT = "output_limit"  # stdout + stderr grew past the byte limit, program killed
    KILLED = "killed"  # died from a signal we did not send (segfault, abort, self-kill)
    PARSE_ERROR = "parse_error"  # the model's tool call did not parse; set by the agent loop
    INTERNAL = "internal"  # the service failed (unreachable, overloaded, bug)

    @property
    def is_failure(self) -> bool:
        """True when the model's code is to blame; an outage must not count against the model."""
        return self not in (ToolStatus.OK, ToolStatus.INTERNAL)


@dataclass
class ToolResult:
    status: ToolStatus
    stdout: str = ""
    stderr: str = ""
    exit_code: int | None = None  # negative: killed by that signal (subprocess convention)
    wall_s: float = 0.0

    def to_dict(self) -> dict[str, Any]:
        return {
            "status": self.status.value,
            "stdout": self.stdout,
            "stderr": self.stderr,
            "exit_code": self.exit_code,
            "wall_s": self.wall_s,
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> ToolResult:
        return cls(
            status=ToolStatus(d["status"]),
            stdout=d.get("stdout", ""),
            stderr=d.get("stderr", ""),
            exit_code=d.get("exit_code"),
            wall_s=float(d.get("wall_s", 0.0)),
        )


@dataclass(frozen=True)
class Sample:
    token_ids: list[int]
    loss_mask: list[int]  # per token of token_ids: 1 where the token is a training target
    advantage: float = 0.0
    # per token of token_ids: log p under the policy that drew it (the engine's); None where the
    # sample was not drawn by an engine (SFT, probes)
    behaviour_logprobs: list[float] | None = None


@dataclass(frozen=True)
class RolloutSpec:
    max_turns: int
    max_response_tokens: int
    temperature: float
    top_p: float
    tool_name: str
    tool_response_chars: int
    tool_spec: str = "schema"


@dataclass
class ToolCallRecord:
    turn: int
    status: ToolStatus
    latency_s: float
    code: str


@dataclass
class TurnTrace:
    """One assistant turn as the engines served it: enough to replay a batch through a scheduler
    simulation (bench/scheduler_sim.py) or read one rollout's timeline."""

    engine: int  # the engine that generated it
    context_tokens: int  # the request's tokens: the prompt and every turn and tool response before
    added_tokens: int  # of those, new since the turn before (the prompt, or the last tool response)
    generated_tokens: int
    started_at: float  # epoch seconds: the request sent to the engine
    ended_at: float  # epoch seconds: the turn back from it
    tool_latency_s: float | None = None  # its tool call, sent to answered; None: no call answered
    tool_response_tokens: int = 0  # what the tool's answer added


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
    behaviour_logprobs: list[float] = field(default_factory=list)  # per response token; 0 on tool tokens
    policy_version: int = 0  # the weights that drew it: the stage's step whose update they start
    turn_traces: list[TurnTrace] = field(default_factory=list)

    @property
    def tokens(self) -> int:
        """Prompt and response so far: what the rollout holds in its engine's KV cache."""
        return len(self.prompt_ids) + len(self.response_ids)

    def extend(self, ids: list[int], text: str, trainable: bool, logprobs: list[float] | None = None) -> None:
        """Append a turn: generated tokens (trainable) with the engine's log-prob of each, or tool
        tokens, which have none (0.0 under the loss mask, never read)."""
        if trainable and (logprobs is None or len(logprobs) != len(ids)):
            given = "no log-probs" if logprobs is None else f"{len(logprobs)} log-probs"
            raise ValueError(
                f"trajectory {self.problem_id} sample {self.sample}, turn {self.turns}: "
                f"the engine returned {given} for {len(ids)} generated tokens"
            )
        self.response_ids += ids
        self.loss_mask += [int(trainable)] * len(ids)
        self.response += text
        self.behaviour_logprobs += logprobs if trainable else [0.0] * len(ids)

    def truncate(self, limit: int) -> None:
        """Keep the first `limit` response tokens (a tool response overshot the budget)."""
        del self.response_ids[limit:], self.loss_mask[limit:], self.behaviour_logprobs[limit:]

    def to_dict(self) -> dict[str, Any]:
        row = asdict(self)
        row["tool_calls"] = [{**asdict(c), "status": c.status.value} for c in self.tool_calls]
        return row

    @classmethod
    def from_dict(cls, row: dict[str, Any]) -> Trajectory:
        calls = [ToolCallRecord(**{**c, "status": ToolStatus(c["status"])}) for c in row["tool_calls"]]
        traces = [TurnTrace(**t) for t in row["turn_traces"]]
        return cls(**{**row, "tool_calls": calls, "turn_traces": traces})


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
    reused: int = 0  # finished before (rolled out ahead, or before an interruption), not drawn again
    stale_dropped: int = 0  # finished before, but by weights too old to train on: drawn again


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


@dataclass
class RunContext:
    """Where a run writes, and its MLflow parent run: plain data, safe to pass to tasks."""

    run_id: str
    run_dir: Path
    mlflow_run_id: str
    output_dir: Path
    tags: dict = field(default_factory=dict)  # MLflow tags every run of this pipeline run carries

    def state_path(self, name: str) -> Path:
        return self.run_dir / "state" / f"{name}.json"

    def checkpoints(self, stage: str) -> Path:
        return self.run_dir / "checkpoints" / stage

    def policy_dir(self, name: str) -> Path:
        """The Hugging Face directory of policy `name` (base, sft or an RL stage)."""
        return self.run_dir / "models" / name
