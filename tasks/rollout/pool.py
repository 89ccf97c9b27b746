"""A pool of vLLM engines behind one interface: `count: 1` runs the engine in this process,
more run one engine per worker process (on GPUs: one per GPU or tensor-parallel group).

Each worker drives its engine step by step on its own, so every engine keeps generating while
the agent loop in this process handles finished turns, tool calls and admissions; the loop talks
to the workers over pipes. Which engine gets which rollout is the scheduler's decision
(tasks/rollout/scheduler.py); the pool reports each engine's KV capacity for it.

Weights travel to the workers as raw bytes per tensor (any dtype, bf16 included). That suits the
small models this runs on CPU; a GPU cluster would broadcast over NCCL instead.
"""

from __future__ import annotations

import multiprocessing as mp
import os
from collections.abc import Iterable
from multiprocessing.connection import Connection, wait
from pathlib import Path

import torch

from tasks.config import EngineConfig
from tasks.rollout.engine import Engine, FinishedTurn, available_cores


def _pack(named_tensors: Iterable[tuple[str, torch.Tensor]]) -> list[tuple[str, str, tuple, bytes]]:
    packed = []
    for name, tensor in named_tensors:
        tensor = tensor.detach().to("cpu").contiguous()
        raw = tensor.view(torch.uint8).numpy().tobytes() if tensor.numel() else b""
        packed.append((name, str(tensor.dtype).removeprefix("torch."), tuple(tensor.shape), raw))
    return packed


def _unpack(packed: list[tuple[str, str, tuple, bytes]]) -> Iterable[tuple[str, torch.Tensor]]:
    for name, dtype, shape, raw in packed:
        flat = torch.frombuffer(bytearray(raw), dtype=torch.uint8) if raw else torch.empty(0, dtype=torch.uint8)
        yield name, flat.view(getattr(torch, dtype)).reshape(shape)


def engine_cores(index: int, threads: int, cores: list[int]) -> list[int]:
    """The cores engine `index` binds its threads to: consecutive blocks of `threads` cores,
    wrapping around (engines then share cores) when engines x threads exceed the cores."""
    threads = min(threads, len(cores))
    return [cores[(index * threads + k) % len(cores)] for k in range(threads)]


def _worker(conn: Connection, index: int, model_dir: str, cfg: dict, seed: int, dtype: str) -> None:
    """One engine process: serve commands, and step the engine whenever it has work."""
    if not torch.cuda.is_available() and hasattr(os, "sched_setaffinity"):
        # Its own block of cores, so that engines' OpenMP threads do not contend for one core.
        os.sched_setaffinity(0, engine_cores(index, cfg["threads"], available_cores()))
    engine = Engine(Path(model_dir), EngineConfig(**cfg), seed, dtype).start()
    conn.send(("ready", engine.kv_tokens()))
    while True:
        # Block for a command only when there is nothing to generate.
        while not engine.has_unfinished() or conn.poll():
            command, *args = conn.recv()
            if command == "add":
                engine.add_request(*args)
            elif command == "load_weights":
                engine.load_weights(_unpack(args[0]))
                conn.send(("done", None))
            elif command == "logprobs":
                conn.send(("done", engine.prompt_logprobs(args[0])))
            elif command == "stats":
                conn.send(("done", engine.stats()))
            elif command == "stop":
                conn.send(("done", None))
                return
        finished = engine.step()
        if finished:
            conn.send(("turns", finished))


class EnginePool:
    def __init__(self, model_dir: Path, cfg: EngineConfig, seed: int, dtype: str = "float32"):
        self.model_dir, self.cfg, self.seed, self.dtype = Path(model_dir), cfg, seed, dtype
        self.local: Engine | None = None
        self.conns: list[Connection] = []
        self.processes: list[mp.Process] = []
        self.kv_tokens: list[int] = []
        # Tokens per rollout of the last batch, of any kind: what cfg.kv_reserve "observed" sizes.
        self.last_rollout_sizes: list[int] = []
        self._queued: list[tuple[int, FinishedTurn]] = []  # finished turns read while awaiting a reply

    @property
    def count(self) -> int:
        return self.cfg.count

    def start(self) -> EnginePool:
        if self.count == 1:
            # Not bound to cores: that would pin the agent loop and the trainer in this process too.
            self.local = Engine(self.model_dir, self.cfg, self.seed, self.dtype).start()
            self.kv_tokens = [self.local.kv_tokens()]
            return self
        context = mp.get_context("spawn")  # a fork would copy this process's torch and vLLM state
        cfg = self.cfg.model_dump()
        for index in range(self.count):
            ours, theirs = context.Pipe()
            process = context.Process(
                target=_worker,
                args=(theirs, index, str(self.model_dir), cfg, self.seed + index, self.dtype),
                name=f"engine-{index}",
                daemon=True,
            )
            process.start()
            theirs.close()
            self.conns.append(ours)
            self.processes.append(process)
        for index, conn in enumerate(self.conns):
            try:
                kind, kv = conn.recv()
            except EOFError:
                self.stop()
                raise RuntimeError(f"engine {index} exited while starting (see its output above)") from None
            self.kv_tokens.append(kv)
        return self

    def __enter__(self) -> EnginePool:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    def stop(self) -> None:
        if self.local is not None:
            self.local.stop()
            self.local = None
        for conn in self.conns:
            try:
                conn.send(("stop",))
            except OSError:
                pass
        for process in self.processes:
            process.join(timeout=30)
            if process.is_alive():
                process.kill()
                process.join()
        self.conns, self.processes = [], []

    # -- generation ------------------------------------------------------------------------------

    def add_request(
        self,
        engine: int,
        request_id: str,
        prompt_ids: list[int],
        max_tokens: int,
        temperature: float,
        top_p: float,
        stop_token_ids: list[int],
    ) -> None:
        args = (request_id, prompt_ids, max_tokens, temperature, top_p, stop_token_ids)
        if self.local is not None:
            self.local.add_request(*args)
        else:
            self.conns[engine].send(("add", *args))

    def poll(self, timeout: float | None) -> list[tuple[int, FinishedTurn]]:
        """Finished turns as (engine, turn). In this process: one engine step (no waiting). With
        workers: whatever they sent, waiting up to `timeout` s (None: until something comes)."""
        if self.local is not None:
            return [(0, turn) for turn in self.local.step()] if self.local.has_unfinished() else []
        finished, self._queued = self._queued, []
        ready = wait(self.conns, timeout=0 if finished else timeout)
        for conn in ready:
            engine = self.conns.index(conn)
            while conn.poll():
                kind, payload = conn.recv()
                if kind != "turns":
                    raise RuntimeError(f"engine {engine} sent {kind!r} while generating")
                finished += [(engine, turn) for turn in payload]
        return finished

    # -- between batches -------------------------------------------------------------------------

    def _call(self, engine: int, *command) -> object:
        self.conns[engine].send(command)
        return self._await_done(engine)

    def load_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Push new weights into every engine in place; each drops its prefix cache."""
        if self.local is not None:
            self.local.load_weights(named_tensors)
            return
        packed = _pack(named_tensors)
        for conn in self.conns:
            conn.send(("load_weights", packed))
        for engine in range(self.count):
            self._await_done(engine)

    def _await_done(self, engine: int) -> object:
        while True:
            kind, payload = self.conns[engine].recv()
            if kind == "done":
                return payload
            self._queued += [(engine, turn) for turn in payload]

    def prompt_logprobs(self, sequences: list[list[int]]) -> list[list[list[float]]]:
        """Each engine's log-probs of the sequences: one list per engine."""
        if self.local is not None:
            return [self.local.prompt_logprobs(sequences)]
        return [self._call(engine, "logprobs", sequences) for engine in range(self.count)]

    def stats(self) -> list[dict]:
        """Per engine: seconds spent generating, preemptions so far, its threads and cores."""
        if self.local is not None:
            return [self.local.stats()]
        return [self._call(engine, "stats") for engine in range(self.count)]
