"""An RL step's rollouts on the running engines, kept as they finish (tasks/store/inflight.py),
and what the engines do while the trainer updates under rl.async (tasks/rl/asynchrony.py)."""

from __future__ import annotations

import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass

from tasks.config import RunConfig, StageConfig
from tasks.records import Problem, Rollouts, RunContext
from tasks.rl import asynchrony
from tasks.rl.batch import step_problems
from tasks.rollout.agent import run_rollouts
from tasks.runtime import Runtime
from tasks.store import inflight

# A failed step waits this long for the turns its engines are generating ahead to come back.
ABANDON_TIMEOUT_S = 120.0


@dataclass(frozen=True)
class StepClock:
    """When a step began, and the engines' busy seconds then: its idle fractions count from here."""

    started: float
    engines_busy_s: float

    @classmethod
    def start(cls, runtime: Runtime) -> StepClock:
        return cls(time.perf_counter(), engines_busy_s(runtime))

    def idle(self, runtime: Runtime, trainer_busy_s: float) -> dict[str, float]:
        """The step's wall time, and the share of it the trainer and the engines sat idle."""
        wall = time.perf_counter() - self.started
        engines_busy = max(0.0, engines_busy_s(runtime) - self.engines_busy_s)
        return {
            "time_step_s": wall,
            "idle/trainer": asynchrony.idle_fraction(trainer_busy_s, wall),
            "idle/engines": asynchrony.idle_fraction(engines_busy, wall, runtime.engines.count),
        }


def engines_busy_s(runtime: Runtime) -> float:
    # (an engine back from a restart counts from zero again: the step's idle share then errs high)
    return sum(s["busy_s"] for s in runtime.engines.stats())


def draw_step(
    runtime: Runtime,
    ctx: RunContext,
    cfg: RunConfig,
    stage: StageConfig,
    step: int,
    problems: list[Problem],
    version: int,
    stop: Callable[[], bool] | None = None,
    desc: str = "",
    abandon: Callable[[], bool] | None = None,
) -> Rollouts:
    """Step `step`'s rollouts: those finished before that the step may train on, the rest drawn
    now by policy `version`, each kept in the step's in-flight folder as it finishes."""
    folder = inflight.step_folder(ctx.run_dir, stage.name, step)
    spec = cfg.rollout.spec(stage)
    if redrawn := inflight.settle(folder, inflight.settings_key(spec, cfg.rl.rollouts_per_problem)):
        print(f"{stage.name} step {step}: {redrawn} rollouts kept under other settings are drawn again")
    finished, dropped = asynchrony.fresh(
        inflight.finished(folder), step, cfg.rl.overlap.staleness_limit, cfg.rl.rollouts_per_problem, version
    )
    inflight.discard(folder, dropped)
    trajectories, times = run_rollouts(
        runtime.engines,
        runtime.tools,
        runtime.tokenizer,
        [(p.problem_id, p.question) for p in problems],
        cfg.rl.rollouts_per_problem,
        spec,
        desc or f"{stage.name} step {step}",
        version=version,
        finished=finished,
        on_finish=lambda index, trajectory: inflight.keep_finished(folder, index, trajectory),
        stop=stop,
        abandon=abandon,
    )
    times.reused, times.stale_dropped = len(finished), len(dropped)
    return Rollouts(problems, trajectories, times)


def roll_ahead(
    runtime: Runtime,
    ctx: RunContext,
    cfg: RunConfig,
    stage: StageConfig,
    step: int,
    problems: list[Problem],
    step_running: Callable[[], bool],
    step_failed: Callable[[], bool],
) -> dict:
    """While step `step` is scored, updated and checkpointed (`step_running()` true), the rollouts
    of the steps after it that rl.async allows, drawn by the weights the engines hold (version
    `step`) and kept in their steps' in-flight folders; returns what it did, for the step's
    metrics. Once `step_failed()`, it starts nothing more, whatever the steps it must draw."""
    must, may = asynchrony.steps_ahead(cfg.rl.overlap, step, stage.steps)
    started, drawn, dropped = time.perf_counter(), 0, 0
    for ahead in must + may:
        if step_failed() or (ahead in may and not step_running()):
            break
        batch_problems = step_problems(problems, stage.problems_per_step, cfg.seed, stage.name, ahead)
        stop = None if ahead in must else (lambda: not step_running())
        rollouts = draw_step(
            runtime,
            ctx,
            cfg,
            stage,
            ahead,
            batch_problems,
            version=step,
            stop=stop,
            desc=f"{stage.name} ahead {ahead}",
            abandon=step_failed,
        )
        drawn += len(rollouts.trajectories) - rollouts.times.reused
        dropped += rollouts.times.stale_dropped
    return {
        "time_roll_ahead_s": time.perf_counter() - started,
        "rollouts_ahead": drawn,
        "staleness/dropped_ahead": dropped,
    }


class RollingAhead:
    """roll_ahead on a thread of its own, started once a step's rollouts are drawn: the engines draw
    the next steps' rollouts while the caller's thread scores the step and the trainer updates
    and checkpoints. `finish` says the step's work is done (no rollout starts after), waits for
    the rollouts in flight and returns what they drew; the weight push comes after it, so no
    rollout spans two versions. With rl.async off it draws nothing and starts no thread.

    It is the context of the step's work: if that fails before `finish`, the drawing is abandoned
    before the error leaves the step (and the runtime its engines and sandboxes belong to goes,
    and the flow is retried)."""

    def __init__(
        self,
        runtime: Runtime,
        ctx: RunContext,
        cfg: RunConfig,
        stage: StageConfig,
        step: int,
        problems: list[Problem],
    ):
        self._step_done, self._step_failed = threading.Event(), threading.Event()
        self._metrics: dict = {}
        self._error: BaseException | None = None
        # Turns and tool calls the driver has sent: none may go out once the step has failed.
        self._sent = lambda: {"turns": runtime.engines.requests, "tool calls": runtime.tools.submitted}
        self.started_after_failure: dict[str, int] | None = None  # set by abandon

        def draw() -> None:
            try:
                self._metrics = roll_ahead(
                    runtime, ctx, cfg, stage, step, problems, self._step_running, self._step_failed.is_set
                )
            except BaseException as error:  # raised where the flow waits for it
                self._error = error

        self._thread: threading.Thread | None = None
        if cfg.rl.overlap.mode != "off":
            # A daemon: a drawing that outlives abandon's timeout does not keep the process.
            self._thread = threading.Thread(target=draw, name=f"roll-ahead-{stage.name}-{step}", daemon=True)
            self._thread.start()

    def __enter__(self) -> RollingAhead:
        return self

    def __exit__(self, error_type, error, trace) -> None:
        if error_type is not None:
            self.abandon()

    def _step_running(self) -> bool:
        return not self._step_done.is_set()

    def finish(self) -> dict:
        self._step_done.set()
        if self._thread is None:
            return {}
        self._thread.join()
        if self._error is not None:
            error, self._error = self._error, None  # raised here: not logged again by abandon
            raise error
        return self._metrics

    def abandon(self, timeout_s: float = ABANDON_TIMEOUT_S) -> None:
        """The step failed before `finish`: the drawing stops before the runtime that serves it
        goes (no rollout, turn or tool call starts; what finished stays kept for the retry). Its
        own error, if any, is logged: the step's is the one raised."""
        self._step_failed.set()
        self._step_done.set()
        if self._thread is None:
            return
        failed_at, sent = time.perf_counter(), self._sent()
        self._thread.join(timeout_s)
        if self._thread.is_alive():
            print(f"drawing ahead still waits on its engines {timeout_s:.0f} s after the step failed")
        self.started_after_failure = {what: n - sent[what] for what, n in self._sent().items()}
        started = ", ".join(f"{n} {what}" for what, n in self.started_after_failure.items())
        waited = time.perf_counter() - failed_at
        print(f"drawing ahead stopped {waited:.1f} s after the step failed, having started since: {started}")
        if self._error is not None:
            print("drawing ahead failed too:\n" + "".join(traceback.format_exception(self._error)))
