"""RoC counts a tool call as failed from the sandbox's structured status, never from its text.

Real programs run in a real sandbox service, called by the real agent loop (`run_rollouts`) whose
turns come from a scripted stand-in for the engines; the trajectories it builds go through the
RL step's own scoring and GRPO-RoC selection (`training_batch`, release mode: deterministic).

Code that only looks wrong (prints "Error:" or "Traceback", warns on stderr, raises and catches
its own exception, asserts its own result, ends with a bare expression) must come back OK and
count as 0 failures; real failures (an uncaught exception, a timeout, a memory error, a killed
process, a tool call that does not parse) must each count as one.

Each case is one problem with 6 rollouts: the case's rollout (one tool call, then the right
answer), two right answers without a tool call (p_err 0.5 each) and three wrong ones. RoC keeps 4,
2 of them positives: the case's rollout is kept iff its call counts as clean (p_err 0 < 0.5 < 1).

Run: .venv/bin/python -m pytest tests/test_roc_status.py -q
"""

import pytest

from dashboards.views import connect
from tasks.config import EnginesConfig, RocConfig
from tasks.records import Problem, Rollouts, RolloutSpec, RolloutTimes, ToolStatus, Trajectory
from tasks.reward.verify import count_answer_blocks
from tasks.rl.batch import training_batch, trajectory_score
from tasks.rollout.agent import run_rollouts
from tasks.rollout.engine import FinishedTurn
from tasks.rollout.format import TOOL_CALL_CLOSE, answer_text, tool_call_text
from tasks.sandbox.client import ToolRunner
from tasks.sandbox.executor import Limits
from tasks.sandbox.server import SandboxService
from tasks.store.tables import ROLLOUTS, rollout_rows, step_part, write_table
from tests.sandbox_helpers import execute

TOOL = "execute_python_code_with_standard_io"
LIMITS = Limits(timeout_s=1.0, cpu_s=1, memory_mb=256, output_bytes=2048)
SPEC = RolloutSpec(
    max_turns=4, max_response_tokens=8192, temperature=1.0, top_p=1.0, tool_name=TOOL, tool_response_chars=256
)
ROLLOUTS_PER_PROBLEM, POSITIVES, KEEP = 6, 3, 4

# name -> (program, text that looks like a failure, in its stdout or stderr)
LOOKS_WRONG = {
    "error_words_on_stdout": (
        "print('Error: k = 0 gives no solution, skipping it')\nprint('Traceback (most recent call last):')\nprint(42)",
        "Traceback (most recent call last):",
    ),
    "warning_on_stderr": (
        "import sys, warnings\n"
        "warnings.warn('float precision may be lost')\n"
        "sys.stderr.write('Error: not really\\n')\n"
        "print(42)",
        "UserWarning: float precision may be lost",
    ),
    "caught_exception": (
        "import traceback\ntry:\n    1 / 0\nexcept ZeroDivisionError:\n    traceback.print_exc()\nprint(42)",
        "ZeroDivisionError: division by zero",
    ),
    "own_assert_holds": (
        "total = sum(range(10))\nassert total == 45, 'Error: wrong sum'\nprint(total - 3)",
        "42",
    ),
    "final_bare_expression": ("x = 6\nx * 7", "42"),  # echoed as IPython would
}
# name -> (the turn's text, the status its call must end with)
FAILS = {
    "uncaught_exception": (tool_call_text(TOOL, "raise ValueError('no root found')"), ToolStatus.ERROR),
    "timeout": (tool_call_text(TOOL, "import time\ntime.sleep(30)"), ToolStatus.TIMEOUT),
    "memory": (tool_call_text(TOOL, "data = bytearray(10**10)"), ToolStatus.MEMORY),
    "killed": (tool_call_text(TOOL, "import os, signal\nos.kill(os.getpid(), signal.SIGKILL)"), ToolStatus.KILLED),
    "parse_error": ("<tool_call>{not json" + TOOL_CALL_CLOSE, ToolStatus.PARSE_ERROR),
}
CALL_TURNS = {name: tool_call_text(TOOL, code) for name, (code, _) in LOOKS_WRONG.items()}
CALL_TURNS.update({name: turn for name, (turn, _) in FAILS.items()})


class CharTokenizer:
    """One token per character, and one for </tool_call>: what the agent loop asks of a tokenizer."""

    CLOSE = 0

    def convert_tokens_to_ids(self, token: str) -> int:
        assert token == TOOL_CALL_CLOSE
        return self.CLOSE

    def __call__(self, text: str, add_special_tokens: bool = False) -> dict[str, list[int]]:
        ids: list[int] = []
        for i, piece in enumerate(text.split(TOOL_CALL_CLOSE)):
            ids += [self.CLOSE] * (i > 0) + [ord(c) + 1 for c in piece]
        return {"input_ids": ids}

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        return "".join(TOOL_CALL_CLOSE if i == self.CLOSE else chr(i - 1) for i in ids)


class ScriptedEngines:
    """One engine whose assistant turns are written in advance, per rollout and turn."""

    def __init__(self, tokenizer: CharTokenizer, turns: list[list[str]]) -> None:
        self.cfg = EnginesConfig(max_model_len=32768)
        self.count, self.kv_tokens, self.serving, self.last_rollout_sizes = 1, [10**7], [True], []
        self.weights_version = self.open_batches = 0
        self.versions: dict[str, int] = {}  # request id -> the version its turn comes back with
        self.tokenizer, self.turns = tokenizer, turns
        self.finished: list[tuple[int, FinishedTurn]] = []
        self.sent: list[str] = []  # request ids, in the order they came

    def add_request(self, engine: int, request_id: str, *_request) -> None:
        self.sent.append(request_id)
        rollout, turn = map(int, request_id.split(":"))
        ids = self.tokenizer(self.turns[rollout][turn])["input_ids"]
        version = self.versions.get(request_id, self.weights_version)
        self.finished.append((engine, FinishedTurn(request_id, ids, "stop", [-1.0] * len(ids), version)))

    def poll(self, timeout: float | None) -> list[tuple[int, FinishedTurn]]:
        finished, self.finished = self.finished, []
        return finished

    def failed(self) -> list[int]:
        return []

    def stats(self) -> list[dict]:
        return [{"busy_s": 0.0, "preemptions": 0}]


def script(call_turn: str, sample: int) -> list[str]:
    """The turns of one rollout: the case's call then the right answer, a right answer alone, or
    a wrong one."""
    if sample == 0:
        return ["Let me compute it." + call_turn, answer_text("42")]
    return [answer_text("42" if sample < POSITIVES else "7")]


@pytest.fixture(scope="module")
def sandbox():
    with SandboxService(workers=2, limits=LIMITS) as service:
        yield service


@pytest.fixture(scope="module")
def selected(sandbox) -> dict[str, tuple[Trajectory, bool]]:
    """Per case, its rollout with a tool call and whether RoC kept it; all cases in one batch."""
    names = list(CALL_TURNS)
    turns = [script(CALL_TURNS[name], sample) for name in names for sample in range(ROLLOUTS_PER_PROBLEM)]
    tokenizer = CharTokenizer()
    with ToolRunner([sandbox.url]) as tools:
        engines = ScriptedEngines(tokenizer, turns)
        problems = [(name, "What is 6 * 7?") for name in names]
        trajectories, times = run_rollouts(engines, tools, tokenizer, problems, ROLLOUTS_PER_PROBLEM, SPEC)
    rollouts = Rollouts([], trajectories, times)
    rollouts.rewards = [float(t.sample < POSITIVES) for t in trajectories]
    rollouts.answer_blocks = [count_answer_blocks(t.response) for t in trajectories]
    batch = training_batch(rollouts, KEEP, RocConfig(mode="release"), seed=0, stage="roc-status", step=0)
    return {t.problem_id: (t, kept) for t, kept in zip(trajectories, batch.kept) if t.sample == 0}


def test_the_scripted_rollouts_run_as_written(selected, tmp_path) -> None:
    for traj, _ in selected.values():
        assert (traj.turns, traj.stop_reason, len(traj.tool_calls)) == (2, "answer", 1), traj.response
        # Each turn's trace: the prompt, then the tool's answer, is what each request added.
        first, second = traj.turn_traces
        assert first.engine == second.engine == 0
        assert first.added_tokens == first.context_tokens == len(traj.prompt_ids)
        assert first.tool_latency_s == traj.tool_calls[0].latency_s and first.tool_response_tokens > 0
        assert second.added_tokens == first.tool_response_tokens and second.tool_latency_s is None
        assert second.context_tokens == first.context_tokens + first.generated_tokens + first.tool_response_tokens
        assert len(traj.prompt_ids) + len(traj.response_ids) == second.context_tokens + second.generated_tokens
        assert first.started_at <= first.ended_at <= second.started_at <= second.ended_at
    # Written with the rollouts, read back one row per turn by the DuckDB view `turns`.
    rollouts = Rollouts([Problem(name, "product", 1, "What is 6 * 7?", "42", "print(6 * 7)") for name in selected],
                        [t for t, _ in selected.values()],
                        RolloutTimes())  # fmt: skip
    rollouts.rewards, rollouts.predicted = [1.0] * len(selected), ["42"] * len(selected)
    write_table(rollout_rows("r", "stage1", 0, rollouts), ROLLOUTS, step_part(tmp_path, "rollouts", "stage1", 0))
    rows = (
        connect(tmp_path)
        .execute(
            "SELECT turn, engine, added_tokens, generated_tokens, tool_latency_s IS NOT NULL, generation_s >= 0 "
            "FROM turns WHERE problem_id = 'error_words_on_stdout' ORDER BY turn"
        )
        .fetchall()
    )
    traj = selected["error_words_on_stdout"][0]
    assert rows == [
        (i, 0, trace.added_tokens, trace.generated_tokens, i == 1, True) for i, trace in enumerate(traj.turn_traces, 1)
    ]


def test_a_turn_drawn_by_other_weights_than_its_batch_began_with_stops_the_batch(sandbox) -> None:
    """A rollout's second turn comes back stamped with the next weights version, as if new
    weights had been loaded while its tool call ran: the batch refuses to go on, naming it."""
    tokenizer = CharTokenizer()
    engines = ScriptedEngines(tokenizer, [script(CALL_TURNS["final_bare_expression"], 0)])
    engines.versions["0:1"] = 1
    with ToolRunner([sandbox.url]) as tools, pytest.raises(RuntimeError) as raised:
        run_rollouts(engines, tools, tokenizer, [("p", "What is 6 * 7?")], 1, SPEC)
    assert str(raised.value) == "rollout p:0 turn 2: engine 0 drew it with weights version 1, its batch began with 0"
    assert engines.open_batches == 0


def test_a_batch_whose_caller_fails_as_turns_come_back_sends_nothing_more(sandbox) -> None:
    """The caller fails (rl.async: the update raised) while the engines hand back two turns whose
    tool calls would go out next: neither call goes out, and no other turn (the loop asks before
    anything starts, not once a round)."""
    tokenizer = CharTokenizer()
    engines = ScriptedEngines(tokenizer, [script(CALL_TURNS["final_bare_expression"], 0)] * 2)
    failed, poll = [], engines.poll

    def poll_as_the_step_fails(timeout: float | None) -> list[tuple[int, FinishedTurn]]:
        failed.append(True)
        return poll(timeout)

    engines.poll = poll_as_the_step_fails
    with ToolRunner([sandbox.url]) as tools:
        problems = [("p", "What is 6 * 7?")]
        ended, _ = run_rollouts(engines, tools, tokenizer, problems, 2, SPEC, abandon=lambda: bool(failed))
        assert tools.submitted == 0
    assert ended == [] and engines.sent == ["0:0", "1:0"] and engines.open_batches == 0


@pytest.mark.parametrize("name", LOOKS_WRONG)
def test_code_that_only_looks_wrong_is_a_clean_call(sandbox, selected, name: str) -> None:
    code, looks_wrong = LOOKS_WRONG[name]
    result = execute(sandbox.url, code)
    assert result.status is ToolStatus.OK, result
    assert looks_wrong in result.stdout + result.stderr  # the program really wrote it
    assert result.stdout.endswith("42\n")
    traj, kept = selected[name]
    assert traj.tool_calls[0].status is ToolStatus.OK
    score = trajectory_score(traj, reward=1.0, answer_blocks=1)
    assert (score.tool_calls, score.tool_failures) == (1, 0)
    assert kept  # ranked above the positives that made no tool call


@pytest.mark.parametrize("name", FAILS)
def test_a_real_failure_counts(selected, name: str) -> None:
    _, status = FAILS[name]
    traj, kept = selected[name]
    assert traj.tool_calls[0].status is status
    score = trajectory_score(traj, reward=1.0, answer_blocks=1)
    assert (score.tool_calls, score.tool_failures) == (1, 1)
    assert not kept  # ranked below the positives that made no tool call
