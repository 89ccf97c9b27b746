"""Which engine runs which rollout, and when: the KV-cache-aware policy and the static baseline.

Pure policy over plain numbers (no vLLM, no I/O), so the same code drives the rollout loop over
real engines and bench/scheduler_sim.py's paper-scale simulation. Both policies share one
interface: `admit()` returns the (rollout, engine) pairs to start now, `finish(rollout)` says a
rollout has ended (all its turns), which may free room for others. A rollout stays on one engine
for all its turns, so each turn finds the previous turns in that engine's prefix cache.

- KV-aware (recipe.md section 6): engine e can hold K_e = kv_tokens_e // max_rollout_tokens
  rollouts without its KV cache ever overflowing, however long they grow. Admit up to K_e per
  engine (the engine with the most free slots first), keep the rest in one global queue, and
  admit the next one the moment any rollout finishes. Engines never evict, and none sits idle
  while another still has a backlog.
- Static: every rollout is split evenly across engines up front (round-robin). Each engine's own
  scheduler then admits what fits in its KV cache now and, when the running rollouts outgrow it,
  evicts some and recomputes them later.
"""

from collections import deque
from collections.abc import Iterable


class KVAwareScheduler:
    def __init__(self, kv_tokens: list[int], max_rollout_tokens: int, rollouts: Iterable[int]):
        if max_rollout_tokens <= 0:
            raise ValueError(f"max_rollout_tokens must be positive, got {max_rollout_tokens}")
        self.slots = [kv // max_rollout_tokens for kv in kv_tokens]
        for engine, (kv, k) in enumerate(zip(kv_tokens, self.slots)):
            if k == 0:
                raise ValueError(
                    f"engine {engine} has a KV cache of {kv} tokens, less than one rollout of "
                    f"{max_rollout_tokens} tokens (prompt + response budget): raise its KV "
                    "memory or lower the stage's max_response_tokens"
                )
        self.waiting = deque(rollouts)
        self.running = [0] * len(self.slots)
        self.engine_of: dict[int, int] = {}

    def admit(self) -> list[tuple[int, int]]:
        started = []
        while self.waiting:
            engine = max(range(len(self.slots)), key=lambda e: (self.slots[e] - self.running[e], -e))
            if self.running[engine] >= self.slots[engine]:
                break
            rollout = self.waiting.popleft()
            self.running[engine] += 1
            self.engine_of[rollout] = engine
            started.append((rollout, engine))
        return started

    def finish(self, rollout: int) -> None:
        self.running[self.engine_of.pop(rollout)] -= 1


class StaticScheduler:
    def __init__(self, n_engines: int, rollouts: Iterable[int]):
        if n_engines <= 0:
            raise ValueError(f"need at least one engine, got {n_engines}")
        self.pending = [(rollout, i % n_engines) for i, rollout in enumerate(rollouts)]

    def admit(self) -> list[tuple[int, int]]:
        started, self.pending = self.pending, []
        return started

    def finish(self, rollout: int) -> None:
        pass


def make_scheduler(
    policy: str, kv_tokens: list[int], max_rollout_tokens: int, rollouts: Iterable[int]
) -> KVAwareScheduler | StaticScheduler:
    if policy == "kv_aware":
        return KVAwareScheduler(kv_tokens, max_rollout_tokens, rollouts)
    if policy == "static":
        return StaticScheduler(len(kv_tokens), rollouts)
    raise ValueError(f"unknown scheduler policy {policy!r}; expected 'kv_aware' or 'static'")
