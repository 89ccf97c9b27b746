"""Which engine runs which rollout, and when: the KV-cache-aware policies and the static baseline.

Pure policy over plain numbers (no vLLM, no I/O), so the same code drives the rollout loop over
real engines and bench/scheduler_sim.py's paper-scale simulation. The policies share one
interface: `admit()` returns the (rollout, engine) pairs to start now (`admit(only)`: of the
rollouts `only` accepts, the others waiting on), `resize(rollout, tokens)` says what a rollout
holds after a turn or a tool's answer, `finish(rollout)` says a
rollout has ended (all its turns), which may free room for others, and `drop_engine(engine)` takes
an engine that died out of the pool and hands back the rollouts it held, to be admitted again on
the others. A rollout stays on one engine for all its turns, so each turn finds the previous
turns in that engine's prefix cache.

- KV-aware (recipe.md section 6): engine e holds K_e = kv_tokens_e // reserve rollouts, with
  `reserve` the KV tokens set aside per rollout. Admit up to K_e per engine (the engine with the
  most free slots first), keep the rest in one global queue, and admit the next one the moment
  any rollout finishes, so that none sits idle while another still has a backlog. The paper
  reserves each rollout's full length (prompt + response budget): then no engine can ever
  overflow, however long its rollouts grow. `reserve_tokens` (below) can instead reserve what
  rollouts were seen to hold: most end far below the budget, so the paper's rule leaves much of
  the cache empty and batches small.
- KV-aware on live sizes (`kv_live`, ours): as KV-aware, each rollout counted at the larger of
  its reserve and what it holds now (`resize()`, at each turn's end), up to an overcommit of
  each engine's cache: 1 never plans past it, more lets the engine preempt where recomputing is
  cheap. On the CPU pool at 8 it ties static, where the paper's reserve takes 1.75-2.26x as long;
  simulated at the paper config at 1 it is 28.5% shorter than static (docs/benchmarks.md).
- Static: every rollout is split evenly across engines up front (round-robin). Each engine's own
  scheduler then admits what fits in its KV cache now and, when the running rollouts outgrow it,
  evicts some and recomputes them later.
"""

import math
from collections import deque
from collections.abc import Callable, Iterable, Sequence


def reserve_tokens(mode: str, max_rollout_tokens: int, previous: Sequence[int] = (), headroom: float = 1.3) -> int:
    """KV tokens the KV-aware policy sets aside per rollout.

    "max_length" (the paper): the rollout's most, prompt + response budget. "observed":
    `headroom` x the mean size (prompt + everything generated and returned by tools) of the
    previous batch's rollouts, the most until there is one. The rollouts running on an engine at
    any moment are each part way through, and over a full engine their sum stays near its mean;
    the headroom covers the spread (bench/scheduler_sim.py at 300K and 200K KV tokens: 1.15
    overflowed 54-70 times a step, 1.3 once in six runs). An engine that overflows anyway
    preempts and recomputes, as without us.
    """
    if mode not in ("max_length", "observed"):
        raise ValueError(f"unknown KV reserve {mode!r}; expected 'max_length' or 'observed'")
    if headroom < 1:
        raise ValueError(f"KV headroom must be at least 1, got {headroom}")
    if mode == "max_length" or not previous:
        return max_rollout_tokens
    mean = sum(previous) / len(previous)
    return max(1, min(max_rollout_tokens, math.ceil(headroom * mean)))


class KVAwareScheduler:
    def __init__(self, kv_tokens: list[int], reserve: int, rollouts: Iterable[int]):
        if reserve <= 0:
            raise ValueError(f"the KV reserve per rollout must be positive, got {reserve}")
        self.slots = [kv // reserve for kv in kv_tokens]
        for engine, (kv, k) in enumerate(zip(kv_tokens, self.slots)):
            if k == 0:
                raise ValueError(
                    f"engine {engine} has a KV cache of {kv} tokens, less than one rollout of "
                    f"{reserve} tokens (its reserve): raise its KV memory or lower the "
                    "stage's max_response_tokens"
                )
        self.waiting = deque(rollouts)
        self.running = [0] * len(self.slots)
        self.engine_of: dict[int, int] = {}

    def admit(self, only: Callable[[int], bool] | None = None) -> list[tuple[int, int]]:
        started = []
        for rollout in [r for r in self.waiting if only is None or only(r)]:
            engine = max(range(len(self.slots)), key=lambda e: (self.slots[e] - self.running[e], -e))
            if self.running[engine] >= self.slots[engine]:
                break
            if only is None:
                self.waiting.popleft()  # the queue's head: no search through a long queue
            else:
                self.waiting.remove(rollout)
            self.running[engine] += 1
            self.engine_of[rollout] = engine
            started.append((rollout, engine))
        return started

    def resize(self, rollout: int, tokens: int) -> None:
        """The rollout's live size, as the driver learns it at a turn's end: this policy plans on
        reserves only."""

    def finish(self, rollout: int) -> None:
        self.running[self.engine_of.pop(rollout)] -= 1

    def drop_engine(self, engine: int) -> list[int]:
        """No more rollouts for `engine`; the ones it held go first in the queue, in order."""
        moved = sorted(r for r, e in self.engine_of.items() if e == engine)
        for rollout in moved:
            del self.engine_of[rollout]
        self.slots[engine] = self.running[engine] = 0
        self.waiting.extendleft(reversed(moved))
        return moved


class LiveKVScheduler(KVAwareScheduler):
    """KV-aware admission on what each engine's rollouts hold now. A rollout counts at the larger
    of its reserve and its live size (prompt, everything generated and every tool result so far,
    as the driver learns it at each turn's end), so one that outgrows its reserve blocks
    admissions on its engine until rollouts end there, and one still short of it keeps its
    reserve for the growth to come. An engine admits while that sum plus a new reserve fits in
    `overcommit` x its KV cache: 1 never plans past the cache (a preemption recomputes a whole
    context, dear on a large model: the paper's regime), more trusts the engine to preempt
    (cheap where a small model's decode step costs about the same for 4 or 20 sequences). Each
    rollout goes to the engine with the most room, from one global queue, and stays there."""

    def __init__(self, kv_tokens: list[int], reserve: int, rollouts: Iterable[int], overcommit: float = 1.0):
        if overcommit < 1:
            raise ValueError(f"KV overcommit must be at least 1, got {overcommit}")
        super().__init__(kv_tokens, reserve, rollouts)
        self.reserve = reserve
        self.room = [overcommit * kv for kv in kv_tokens]
        self.held = [0] * len(kv_tokens)  # per engine: sum of max(reserve, live size) of its rollouts
        self.size: dict[int, int] = {}

    def admit(self, only: Callable[[int], bool] | None = None) -> list[tuple[int, int]]:
        started = []
        for rollout in [r for r in self.waiting if only is None or only(r)]:
            engine = max(range(len(self.room)), key=lambda e: (self.room[e] - self.held[e], -e))
            if self.held[engine] + self.reserve > self.room[engine]:
                break
            if only is None:
                self.waiting.popleft()
            else:
                self.waiting.remove(rollout)
            self.running[engine] += 1
            self.held[engine] += self.reserve
            self.engine_of[rollout] = engine
            self.size[rollout] = 0
            started.append((rollout, engine))
        return started

    def resize(self, rollout: int, tokens: int) -> None:
        if rollout not in self.engine_of:
            return
        before = max(self.reserve, self.size[rollout])
        self.size[rollout] = tokens
        self.held[self.engine_of[rollout]] += max(self.reserve, tokens) - before

    def finish(self, rollout: int) -> None:
        engine = self.engine_of[rollout]
        self.held[engine] -= max(self.reserve, self.size.pop(rollout))
        super().finish(rollout)

    def drop_engine(self, engine: int) -> list[int]:
        moved = super().drop_engine(engine)
        for rollout in moved:
            del self.size[rollout]
        self.room[engine] = self.held[engine] = 0
        return moved


class StaticScheduler:
    def __init__(self, n_engines: int, rollouts: Iterable[int]):
        if n_engines <= 0:
            raise ValueError(f"need at least one engine, got {n_engines}")
        self.engines = list(range(n_engines))
        self.pending = [(rollout, i % n_engines) for i, rollout in enumerate(rollouts)]
        self.engine_of: dict[int, int] = {}

    def admit(self, only: Callable[[int], bool] | None = None) -> list[tuple[int, int]]:
        started = [(r, e) for r, e in self.pending if only is None or only(r)]
        self.pending = [(r, e) for r, e in self.pending if not (only is None or only(r))]
        self.engine_of.update(started)
        return started

    def resize(self, rollout: int, tokens: int) -> None:
        """The rollout's live size, as the driver learns it at a turn's end: the engines' own
        schedulers see it."""

    def finish(self, rollout: int) -> None:
        self.engine_of.pop(rollout, None)

    def drop_engine(self, engine: int) -> list[int]:
        """The engine's rollouts, admitted or not, dealt round-robin over the engines left."""
        if engine not in self.engines:
            return []
        self.engines.remove(engine)
        moved = sorted(r for r, e in self.engine_of.items() if e == engine)
        for rollout in moved:
            del self.engine_of[rollout]
        again = moved + [r for r, e in self.pending if e == engine]
        self.pending = [(r, e) for r, e in self.pending if e != engine]
        if self.engines:
            self.pending += [(r, self.engines[i % len(self.engines)]) for i, r in enumerate(again)]
        return again


def make_scheduler(
    policy: str, kv_tokens: list[int], reserve: int, rollouts: Iterable[int], overcommit: float = 1.0
) -> KVAwareScheduler | StaticScheduler:
    if policy == "kv_aware":
        return KVAwareScheduler(kv_tokens, reserve, rollouts)
    if policy == "kv_live":
        return LiveKVScheduler(kv_tokens, reserve, rollouts, overcommit)
    if policy == "static":
        return StaticScheduler(len(kv_tokens), rollouts)
    raise ValueError(f"unknown scheduler policy {policy!r}; expected 'kv_aware', 'kv_live' or 'static'")
