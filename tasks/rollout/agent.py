"""The multi-turn agent loop: generate until a tool call, run it, feed the result back.

Every trajectory advances independently: when a turn finishes with a tool call, the call goes
to the sandbox at once and the engines keep serving the other trajectories; when the result
arrives, the continuation is submitted as a new request on the exact token ids so far, to the
same engine (the earlier turns are served from its prefix cache). Which engine serves a
trajectory, and when it starts, is the scheduler's call (tasks/rollout/scheduler.py). When an
engine dies, the trajectories it held go back to the scheduler and continue on the others from
their last finished turn: the turn in flight is generated again, nothing is duplicated.

Invalid model output never raises: a malformed tool call is answered with the parse error as
the tool response (recipe.md section 2), a missing answer or a runaway length ends the
trajectory with a recorded stop reason, and scoring gives it reward 0.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from concurrent.futures import FIRST_COMPLETED, Future, wait
from typing import Protocol

from tqdm import tqdm

from tasks.config import EnginesConfig
from tasks.records import RolloutSpec, RolloutTimes, ToolCallRecord, ToolResult, ToolStatus, Trajectory, TurnTrace
from tasks.rollout.engine import FinishedTurn
from tasks.rollout.format import (
    ANSWER_OPEN,
    TOOL_CALL_CLOSE,
    ToolCall,
    ToolCallError,
    parse_tool_call,
    prompt_text,
    tool_response_text,
    truncate_middle,
)
from tasks.rollout.scheduler import make_scheduler, reserve_tokens
from tasks.sandbox.client import ToolRunner


def render_tool_result(result: ToolResult, max_chars: int) -> str:
    """What the model reads back: output, or the traceback, or the limit it hit."""
    if result.status is ToolStatus.OK:
        text = result.stdout
    elif result.status is ToolStatus.TIMEOUT:
        text = result.stdout + "\nTimeoutError: the program ran out of time"
    elif result.status is ToolStatus.INTERNAL:
        text = "The tool is unavailable: " + result.stderr
    else:
        text = result.stdout + result.stderr
    return truncate_middle(text.strip(), max_chars)


def end_turn(
    traj: Trajectory,
    token_ids: list[int],
    text: str,
    finish_reason: str,
    spec: RolloutSpec,
    tool_call_close: int,
    logprobs: list[float],
) -> ToolCall | ToolCallError | None:
    """Record a finished assistant turn (with the engine's log-probs of its tokens) and say what
    comes next.

    Returns the tool call to run, the parse error to answer with, or None when the trajectory
    is over (its stop_reason then says why).
    """
    traj.turns += 1
    traj.extend(token_ids, text, trainable=True, logprobs=logprobs)
    if not token_ids or token_ids[-1] != tool_call_close:
        if finish_reason == "length":
            traj.stop_reason = "budget"
        else:
            traj.stop_reason = "answer" if ANSWER_OPEN in text else "no_answer"
        return None
    if traj.turns >= spec.max_turns:
        traj.stop_reason = "max_turns"
        return None
    try:
        call = parse_tool_call(text, spec.tool_name)
    except ToolCallError as exc:
        traj.tool_calls.append(ToolCallRecord(traj.turns, ToolStatus.PARSE_ERROR, 0.0, ""))
        return exc
    traj.tool_calls.append(ToolCallRecord(traj.turns, ToolStatus.INTERNAL, 0.0, call.code))
    return call


class EngineGroupLike(Protocol):
    """What the loop needs of the engines that serve it: tasks/cluster/engines.py's EngineGroup,
    which this layer does not import."""

    cfg: EnginesConfig
    count: int
    kv_tokens: list[int]
    serving: list[bool]  # False for an engine that died (until it is back, with the weights)
    last_rollout_sizes: list[int]
    weights_version: int  # what the serving engines hold, and stamp on every turn they finish
    open_batches: int  # batches under way, during which no weights may be loaded

    def add_request(self, engine: int, *request) -> None: ...  # request: as Engine.add_request

    def poll(self, timeout: float | None) -> list[tuple[int, FinishedTurn]]: ...

    def failed(self) -> list[int]: ...  # engines found dead since the last call

    def stats(self) -> list[dict]: ...


class _Batch:
    """One rollout batch as the loop drives it: which engine holds each rollout, which rollouts
    are generating, and which wait on a tool call. Three parts act on it, in this order each
    round: admission (the scheduler says which rollout starts where, and when), the turn loop
    (a finished turn ends the rollout or sends its tool call; an answered call submits the next
    turn), and the re-queue of a dead engine's rollouts."""

    def __init__(
        self,
        engines: EngineGroupLike,
        tools: ToolRunner,
        tokenizer,
        problems,
        samples_per_problem,
        spec,
        version: int = 0,
        finished: dict[int, Trajectory] | None = None,
        on_finish: Callable[[int, Trajectory], None] | None = None,
        abandon: Callable[[], bool] | None = None,
    ):
        self.engines, self.tools, self.tokenizer, self.spec = engines, tools, tokenizer, spec
        self.abandon_asked = abandon
        self.weights_version = engines.weights_version  # every turn of the batch is drawn by these
        self.times = RolloutTimes()
        self.tool_call_close = tokenizer.convert_tokens_to_ids(TOOL_CALL_CLOSE)
        self.max_model_len = engines.cfg.max_model_len
        self.on_finish = on_finish
        self.trajectories: list[Trajectory] = []
        for problem_id, question in problems:
            text = prompt_text(question, spec.tool_name, spec.tool_spec)
            prompt_ids = tokenizer(text, add_special_tokens=False)["input_ids"]
            self.trajectories += [
                Trajectory(problem_id, s, prompt_ids, policy_version=version) for s in range(samples_per_problem)
            ]
        self.ended: set[int] = set()
        self.group_size = samples_per_problem
        for index, done in (finished or {}).items():
            fresh = self.trajectories[index] if index < len(self.trajectories) else None
            # The same prompt too: a changed template, tool list or tokenizer draws it again.
            if fresh is not None and (done.problem_id, done.sample, done.prompt_ids) == (
                fresh.problem_id,
                fresh.sample,
                fresh.prompt_ids,
            ):
                self.trajectories[index] = done
                self.ended.add(index)
        to_draw = [i for i in range(len(self.trajectories)) if i not in self.ended]
        longest = max((len(self.trajectories[i].prompt_ids) for i in to_draw), default=0)
        cfg = engines.cfg
        full_length = min(self.max_model_len, longest + spec.max_response_tokens)
        self.times.kv_reserve_tokens = reserve_tokens(
            cfg.kv_reserve, full_length, engines.last_rollout_sizes, cfg.kv_headroom
        )
        self.scheduler = make_scheduler(
            cfg.scheduler, engines.kv_tokens, self.times.kv_reserve_tokens, to_draw, cfg.kv_overcommit
        )
        for engine, serving in enumerate(engines.serving):
            if not serving:
                self.scheduler.drop_engine(engine)
        self.engine_of: dict[int, int] = {}
        self.generating: set[int] = set()
        self.pending_tools: dict[int, tuple[Future, float]] = {}
        self.sent_at: dict[int, float] = {}  # when each generating rollout's turn went to its engine
        self.active: set[int] = set()  # admitted, not ended
        # Groups (a problem's rollouts) admitted or finished before: once the batch is closed only
        # these go on, so that it ends with whole groups, each drawn by one policy.
        self.started_groups = {index // self.group_size for index in self.ended}
        self.closed = False  # no more groups start: the batch ends once the started ones are done
        self.abandoned = False  # no more turns or tool calls either: it ends once the engines are idle

    @property
    def finished(self) -> int:
        return len(self.ended)

    @property
    def done(self) -> bool:
        if self.abandoned:
            return not self.generating
        if self.closed:  # once every started group has ended, whole
            started = (i for i in range(len(self.trajectories)) if i // self.group_size in self.started_groups)
            return not self.active and all(i in self.ended for i in started)
        return self.finished == len(self.trajectories)

    def abandon(self) -> None:
        """The caller failed: start nothing more (no rollout, turn or tool call); the turns the
        engines are generating are taken and dropped, so that no request outlives the batch."""
        self.closed = self.abandoned = True
        self.pending_tools.clear()

    def abandoning(self) -> bool:
        """Asked right before anything starts, not once a round: a round can wait on a turn for
        seconds, and nothing may start once the caller has failed."""
        if not self.abandoned and self.abandon_asked is not None and self.abandon_asked():
            self.abandon()
        return self.abandoned

    # -- admission -----------------------------------------------------------------------------

    def admit(self) -> None:
        """Start what the scheduler allows now: at the start, and as soon as rollouts end; once
        the batch is closed, only the rest of the groups already started."""
        if self.abandoning():
            return
        started = (lambda index: index // self.group_size in self.started_groups) if self.closed else None
        for index, engine in self.scheduler.admit(started):
            self.started_groups.add(index // self.group_size)
            self.engine_of[index] = engine
            self.active.add(index)
            if index not in self.pending_tools:  # a moved rollout waiting on a tool goes on when it answers
                self.submit_turn(index)

    # -- the turn loop -------------------------------------------------------------------------

    def submit_turn(self, index: int) -> None:
        """Ask the rollout's engine for its next assistant turn, or end the rollout when no
        budget is left."""
        traj, spec = self.trajectories[index], self.spec
        budget = min(
            spec.max_response_tokens - len(traj.response_ids),
            self.max_model_len - len(traj.prompt_ids) - len(traj.response_ids),
        )
        if budget <= 0:
            traj.stop_reason = "budget"
            # A tool response may overshoot the shared budget: the trainer never sees past it.
            limit = min(spec.max_response_tokens, self.max_model_len - len(traj.prompt_ids))
            traj.truncate(limit)
            self.end_rollout(index)
            return
        if self.abandoning():
            return
        self.sent_at[index] = time.time()
        self.engines.add_request(
            self.engine_of[index],
            f"{index}:{traj.turns}",
            traj.prompt_ids + traj.response_ids,
            budget,
            spec.temperature,
            spec.top_p,
            [self.tool_call_close],
        )
        self.generating.add(index)

    def end_rollout(self, index: int) -> None:
        self.ended.add(index)
        self.active.discard(index)
        self.scheduler.finish(index)
        if self.on_finish is not None:
            self.on_finish(index, self.trajectories[index])

    def next_turns(self) -> list[tuple[int, FinishedTurn]]:
        """The turns finished by now: polled while anything generates (briefly when a tool call
        may answer first); with nothing to generate, none, after the first tool call answers."""
        if self.generating:
            return self.engines.poll(timeout=0.005 if self.pending_tools else None)
        if self.pending_tools:
            waited_from = time.perf_counter()
            wait([f for f, _ in self.pending_tools.values()], return_when=FIRST_COMPLETED)
            self.times.tool_wait_s += time.perf_counter() - waited_from
        return []

    def end_turns(self, turns: list[tuple[int, FinishedTurn]]) -> None:
        """Each finished turn ends its rollout, or sends its tool call (a call that does not
        parse is answered with the parse error, recipe.md section 2)."""
        for engine, turn in turns:
            index = int(turn.request_id.split(":")[0])
            self.generating.discard(index)
            if self.abandoning():
                continue
            traj = self.trajectories[index]
            if turn.weights_version != self.weights_version:
                raise RuntimeError(
                    f"rollout {traj.problem_id}:{traj.sample} turn {traj.turns + 1}: engine {engine} drew it with "
                    f"weights version {turn.weights_version}, its batch began with {self.weights_version}"
                )
            self.trace_turn(traj, engine, len(turn.token_ids), self.sent_at.pop(index))
            text = self.tokenizer.decode(turn.token_ids, skip_special_tokens=False)
            action = end_turn(
                traj, turn.token_ids, text, turn.finish_reason, self.spec, self.tool_call_close, turn.logprobs
            )
            self.scheduler.resize(index, traj.tokens)
            if action is None:
                self.end_rollout(index)
            elif isinstance(action, ToolCallError):
                future = Future()
                future.set_result(ToolResult(status=ToolStatus.PARSE_ERROR, stderr=str(action)))
                self.pending_tools[index] = (future, time.perf_counter())
            elif not self.abandoning():
                self.pending_tools[index] = (self.tools.submit(action.code, action.stdin), time.perf_counter())

    @staticmethod
    def trace_turn(traj: Trajectory, engine: int, generated: int, sent_at: float) -> None:
        context = traj.tokens
        last = traj.turn_traces[-1] if traj.turn_traces else None
        added = context - (last.context_tokens + last.generated_tokens) if last else context
        traj.turn_traces.append(TurnTrace(engine, context, added, generated, sent_at, time.time()))

    def answer_tools(self) -> None:
        """Each answered tool call goes into its rollout, whose next turn is submitted."""
        for index in [i for i, (f, _) in self.pending_tools.items() if f.done()]:
            if self.abandoning():  # the calls it waited on are dropped with it
                return
            future, sent_at = self.pending_tools.pop(index)
            result: ToolResult = future.result()
            traj = self.trajectories[index]
            record = traj.tool_calls[-1]
            record.status, record.latency_s = result.status, time.perf_counter() - sent_at
            self.times.tool_exec_s += result.wall_s
            text = tool_response_text(render_tool_result(result, self.spec.tool_response_chars))
            ids = self.tokenizer(text, add_special_tokens=False)["input_ids"]
            traj.extend(ids, text, trainable=False)
            self.scheduler.resize(index, traj.tokens)
            traj.turn_traces[-1].tool_latency_s, traj.turn_traces[-1].tool_response_tokens = record.latency_s, len(ids)
            if index in self.engine_of:  # else its engine died: it goes on once admitted elsewhere
                self.submit_turn(index)

    # -- the re-queue of a dead engine's rollouts -------------------------------------------------

    def requeue(self, engine: int) -> None:
        """Engine `engine` died: the rollouts it held go back to the scheduler, to continue on
        another engine from their last finished turn (the turn in flight is generated again)."""
        self.times.engine_deaths += 1
        if self.engines.serving[engine]:
            return  # found dead between batches, and back (with the weights) before this one began
        for index in self.scheduler.drop_engine(engine):
            if self.engine_of.pop(index, None) is not None:  # started there (not just dealt to it)
                self.times.requeued_rollouts += 1
            self.generating.discard(index)
            self.active.discard(index)


def run_rollouts(
    engines: EngineGroupLike,
    tools: ToolRunner,
    tokenizer,
    problems: list[tuple[str, str]],
    samples_per_problem: int,
    spec: RolloutSpec,
    desc: str = "rollouts",
    version: int = 0,
    finished: dict[int, Trajectory] | None = None,
    on_finish: Callable[[int, Trajectory], None] | None = None,
    stop: Callable[[], bool] | None = None,
    abandon: Callable[[], bool] | None = None,
) -> tuple[list[Trajectory], RolloutTimes]:
    """Roll out `samples_per_problem` trajectories for each (problem_id, question) on the engines,
    each rollout's engine chosen by the scheduler their config names; the KV-aware scheduler's
    reserve per rollout comes from that config and the sizes of the previous batch
    (tasks/rollout/scheduler.py).

    `finished` (batch index -> trajectory) are rollouts of the batch drawn before: they are not
    drawn again. Each rollout that ends goes to `on_finish(index, trajectory)` at once. Once
    `stop()` is true no group (a problem's rollouts) starts, the started ones finish whole, and
    the finished rollouts (in batch order) are returned. Once `abandon()` is true nothing more
    starts, not even a rollout's next turn: the batch returns what ended before, once the engines
    hand back the turns they were generating. New trajectories carry policy `version`."""
    started = time.perf_counter()
    busy_before = engines.stats()
    retried_before = tools.client.retried
    batch = _Batch(
        engines, tools, tokenizer, problems, samples_per_problem, spec, version, finished, on_finish, abandon
    )
    engines.open_batches += 1
    try:
        with tqdm(total=len(batch.trajectories), initial=batch.finished, desc=desc, leave=False, disable=None) as bar:
            while not batch.done:
                finished = batch.finished
                batch.closed = batch.closed or (stop is not None and stop())
                batch.admit()
                batch.end_turns(batch.next_turns())
                for engine in engines.failed():
                    batch.requeue(engine)
                batch.answer_tools()
                bar.update(batch.finished - finished)
    finally:
        engines.open_batches -= 1
    times = batch.times
    trajectories = [t for i, t in enumerate(batch.trajectories) if i in batch.ended]
    times.total_s = time.perf_counter() - started
    busy_after = engines.stats()
    # (an engine back from a restart counts from zero again)
    busy = sum(max(0.0, a["busy_s"] - b["busy_s"]) for a, b in zip(busy_after, busy_before))
    times.engine_idle_fraction = max(0.0, 1 - busy / (times.total_s * engines.count)) if times.total_s else 0.0
    times.sandbox_retries = tools.client.retried - retried_before
    times.preemptions = sum(max(0, a["preemptions"] - b["preemptions"]) for a, b in zip(busy_after, busy_before))
    engines.last_rollout_sizes = [t.tokens for t in trajectories]
    return trajectories, times
