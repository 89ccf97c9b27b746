"""The sandbox as an HTTP service, its command line, and the lifecycle object that runs it.

    POST /execute        {"code": str, "input": str}          -> ToolResult.to_dict()
    POST /execute_batch  {"requests": [{"code", "input"}...]} -> {"results": [...]}, same order
    GET  /health                                               -> {"status": "ok", "pid": int}
    GET  /stats          in flight, done, rejected, counts by status, latency p50/p99

At most `workers` programs run at once; at most `max_queue` more calls wait for a slot. Past that
the server answers 503 {"error": "busy"} at once, so an overloaded sandbox pushes back on its
callers instead of growing an unbounded queue (the client retries 503 with a backoff).

Calls are forked from a warm template process (numpy, sympy pre-loaded; see executor.py and
zygote.py); `--spawn` starts a fresh interpreter per call instead. The isolation the kernel
allowed is logged at start-up, one line per layer.

    python -m tasks.sandbox.server serve --port 8123 --workers 4
"""

import argparse
import asyncio
import collections
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import fields
from pathlib import Path
from typing import Any

from aiohttp import web

from tasks.sandbox.executor import Limits, TemplatePool, run_python
from tasks.sandbox.status import ToolResult

# The directory that holds the `tasks` package, so `python -m tasks.sandbox.server` resolves
# whether or not the project is installed.
_PACKAGE_ROOT = Path(__file__).resolve().parents[2]


class _BadRequest(Exception):
    pass


def _parse_call(item: Any, where: str = "") -> tuple[str, str]:
    """(code, input) from one request object; `where` (e.g. "requests[3]") names it in errors."""
    prefix = f"{where}." if where else ""
    if not isinstance(item, dict):
        raise _BadRequest(f"'{where}' must be a JSON object with 'code' and 'input'")
    if "code" not in item:
        raise _BadRequest(f"'{prefix}code' is missing")
    code = item["code"]
    if not isinstance(code, str):
        raise _BadRequest(f"'{prefix}code' must be a string, got {type(code).__name__}")
    stdin = item.get("input", "")  # optional: most programs read no input
    if not isinstance(stdin, str):
        raise _BadRequest(f"'{prefix}input' must be a string, got {type(stdin).__name__}")
    return code, stdin


def _percentile(sorted_values: list[float], q: float) -> float | None:
    """Nearest-rank percentile, q in [0, 1]."""
    if not sorted_values:
        return None
    return sorted_values[min(len(sorted_values) - 1, int(q * len(sorted_values)))]


class _Sandbox:
    """Admission control, execution and counters behind the HTTP handlers."""

    def __init__(
        self, workers: int, max_queue: int, limits: Limits, latency_window: int, template: bool
    ) -> None:
        self.pool = TemplatePool(limits, workers) if template else None
        self.workers = workers
        self.max_queue = max_queue
        self.limits = limits
        self.slots = asyncio.Semaphore(workers)
        self.pending = 0  # admitted calls not yet finished: running + waiting
        self.running = 0
        self.done = 0
        self.rejected = 0
        self.by_status: collections.Counter[str] = collections.Counter()
        self.latencies: collections.deque[float] = collections.deque(maxlen=latency_window)

    def admit(self, n_calls: int) -> None:
        # Check and increment with no await in between: the event loop makes this atomic.
        if self.pending + n_calls > self.workers + self.max_queue:
            self.rejected += n_calls
            raise web.HTTPServiceUnavailable(
                text='{"error": "busy"}', content_type="application/json"
            )
        self.pending += n_calls

    async def run(self, code: str, stdin: str) -> ToolResult:
        """Run one admitted call; latency includes its time in the queue."""
        started = time.monotonic()
        try:
            async with self.slots:
                self.running += 1
                try:
                    if self.pool is not None:
                        result = await self.pool.run(code, stdin)
                    else:
                        result = await run_python(code, stdin, self.limits)
                finally:
                    self.running -= 1
        finally:
            self.pending -= 1
        self.done += 1
        self.by_status[result.status.value] += 1
        self.latencies.append(time.monotonic() - started)
        return result

    async def read_body(self, request: web.Request) -> dict[str, Any]:
        try:
            body = await request.json()
        except ValueError as exc:
            raise _BadRequest(f"request body is not valid JSON: {exc}") from None
        if not isinstance(body, dict):
            raise _BadRequest("request body must be a JSON object")
        return body

    async def execute(self, request: web.Request) -> web.Response:
        try:
            code, stdin = _parse_call(await self.read_body(request))
        except _BadRequest as exc:
            return web.json_response({"error": str(exc)}, status=400)
        self.admit(1)
        return web.json_response((await self.run(code, stdin)).to_dict())

    async def execute_batch(self, request: web.Request) -> web.Response:
        try:
            items = (await self.read_body(request)).get("requests")
            if not isinstance(items, list):
                raise _BadRequest("'requests' must be a list of {code, input} objects")
            calls = [_parse_call(item, f"requests[{i}]") for i, item in enumerate(items)]
        except _BadRequest as exc:
            return web.json_response({"error": str(exc)}, status=400)
        capacity = self.workers + self.max_queue
        if len(calls) > capacity:
            # Would never be admitted; a 503 would make the client retry in vain.
            message = (
                f"batch of {len(calls)} calls exceeds the capacity of {capacity} "
                "(workers + max_queue); send smaller batches"
            )
            return web.json_response({"error": message}, status=413)
        self.admit(len(calls))
        results = await asyncio.gather(*(self.run(code, stdin) for code, stdin in calls))
        return web.json_response({"results": [r.to_dict() for r in results]})

    async def health(self, request: web.Request) -> web.Response:
        # The pid lets SandboxService tell its own server from another one already on the port.
        return web.json_response({"status": "ok", "pid": os.getpid()})

    async def stats(self, request: web.Request) -> web.Response:
        latencies = sorted(self.latencies)
        return web.json_response(
            {
                "in_flight": self.pending,
                "running": self.running,
                "queued": self.pending - self.running,
                "done": self.done,
                "rejected": self.rejected,
                "by_status": dict(self.by_status),
                "latency_window": len(latencies),
                "latency_p50_s": _percentile(latencies, 0.50),
                "latency_p99_s": _percentile(latencies, 0.99),
                "workers": self.workers,
                "max_queue": self.max_queue,
                "template": None if self.pool is None else {
                    "alive": self.pool.alive(), "restarts": self.pool.restarts, **self.pool.report,
                    "cells": [cell.pid if cell else None for cell in self.pool.cells],
                },
            }
        )


def create_app(
    workers: int = 4,
    max_queue: int = 4096,
    limits: Limits = Limits(),
    latency_window: int = 1000,
    template: bool = True,
) -> web.Application:
    """`template`: fork calls from a warm pre-loaded process (else one fresh interpreter each)."""
    sandbox = _Sandbox(workers, max_queue, limits, latency_window, template)
    # Batches of long programs are large; aiohttp's default cap is 1 MiB.
    app = web.Application(client_max_size=64 << 20)
    app.add_routes(
        [
            web.post("/execute", sandbox.execute),
            web.post("/execute_batch", sandbox.execute_batch),
            web.get("/health", sandbox.health),
            web.get("/stats", sandbox.stats),
        ]
    )
    if sandbox.pool is not None:
        pool = sandbox.pool

        async def start_pool(app: web.Application) -> None:
            try:
                await pool.start()
                await pool.start_cells()
            except (OSError, RuntimeError) as exc:
                pool.log(f"{exc}; will retry on the first call")

        async def stop_pool(app: web.Application) -> None:
            pool.close()

        app.on_startup.append(start_pool)
        app.on_cleanup.append(stop_pool)
    return app


async def _watch_parent(app: web.Application) -> None:
    """Stop (as on SIGTERM: cells and template closed) once our parent is gone: a pipeline
    killed with SIGKILL cannot stop the service it started, and an orphan would hold its port."""
    parent = os.getppid()

    async def watch() -> None:
        while os.getppid() == parent:
            await asyncio.sleep(1.0)
        print("sandbox: the process that started it is gone; stopping", file=sys.stderr, flush=True)
        os.kill(os.getpid(), signal.SIGTERM)

    app["parent_watch"] = asyncio.get_running_loop().create_task(watch())


def _limit_flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="rstar2-sandbox", description=__doc__.split("\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    serve = commands.add_parser("serve", help="run the sandbox HTTP service")
    serve.add_argument("--host", default="127.0.0.1", help="interface to listen on")
    serve.add_argument("--port", type=int, default=8123)
    serve.add_argument("--workers", type=int, default=4, help="programs running at once")
    serve.add_argument(
        "--max-queue", type=int, default=4096, help="calls that may wait for a worker; more get 503"
    )
    serve.add_argument(
        "--exit-with-parent",
        action="store_true",
        help="stop when the process that started this one dies (even by SIGKILL)",
    )
    serve.add_argument(
        "--spawn",
        action="store_true",
        help="start a fresh interpreter per call instead of forking from a warm template",
    )
    # One flag per Limits field, so SandboxService can forward every limit it was given.
    for f in fields(Limits):
        serve.add_argument(
            _limit_flag(f.name), type=type(f.default), default=f.default, help=f.metadata["help"]
        )
    args = parser.parse_args(argv)

    limits = Limits(**{f.name: getattr(args, f.name) for f in fields(Limits)})
    app = create_app(args.workers, args.max_queue, limits, template=not args.spawn)
    if args.exit_with_parent:
        app.on_startup.append(_watch_parent)
    print(
        f"sandbox on http://{args.host}:{args.port}: {args.workers} workers, "
        f"queue {args.max_queue}, {limits}",
        file=sys.stderr,
        flush=True,
    )
    # A short shutdown grace: on SIGTERM, calls still running are cancelled, which kills their
    # process groups, rather than holding the stop for up to a full queue of work.
    web.run_app(
        app, host=args.host, port=args.port, access_log=None, print=None, shutdown_timeout=2.0
    )


# ------------------------------------------------------------------------------------------------
# Lifecycle object: the flows and the tests start the service through this.


def _free_port(host: str) -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


# No proxy: an http_proxy set in the environment must not intercept calls to our own server.
_DIRECT = urllib.request.build_opener(urllib.request.ProxyHandler({}))


class SandboxService:
    """Runs `python -m tasks.sandbox.server serve` as a child process; a context manager.

    The server's output goes to `log_path` (kept), or to a temporary file removed at stop().
    """

    def __init__(
        self,
        host: str = "127.0.0.1",
        port: int | None = None,
        workers: int = 4,
        limits: Limits = Limits(),
        max_queue: int = 4096,
        startup_timeout_s: float = 30.0,
        log_path: Path | None = None,
    ) -> None:
        self.host = host
        self.port = port
        self.workers = workers
        self.limits = limits
        self.max_queue = max_queue
        self.startup_timeout_s = startup_timeout_s
        self.log_path = log_path
        self._remove_log = False
        self._process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        if self.port is None:
            raise RuntimeError("SandboxService has no port until start()")
        return f"http://{self.host}:{self.port}"

    def start(self) -> "SandboxService":
        if self._process is not None:
            raise RuntimeError(f"SandboxService already running at {self.url}")
        if self.port is None:
            self.port = _free_port(self.host)
        if self.log_path is None:
            fd, name = tempfile.mkstemp(prefix="rstar2-sandbox-server-", suffix=".log")
            os.close(fd)
            self.log_path, self._remove_log = Path(name), True
        argv = [
            sys.executable, "-m", "tasks.sandbox.server", "serve",
            "--host", self.host, "--port", str(self.port),
            "--workers", str(self.workers), "--max-queue", str(self.max_queue), "--exit-with-parent",
        ]  # fmt: skip
        for f in fields(Limits):
            argv += [_limit_flag(f.name), str(getattr(self.limits, f.name))]
        with open(self.log_path, "ab") as log:
            self._process = subprocess.Popen(
                argv,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                cwd=_PACKAGE_ROOT,
                env={**os.environ, "OMP_NUM_THREADS": "1"},
                start_new_session=True,  # a Ctrl-C meant for the caller should not hit the server
            )
        self._wait_until_healthy()
        return self

    def _wait_until_healthy(self) -> None:
        assert self._process is not None
        deadline = time.monotonic() + self.startup_timeout_s
        while True:
            returncode = self._process.poll()
            if returncode is not None:
                log = self._log_tail()
                self.stop()
                raise RuntimeError(
                    f"sandbox server exited with code {returncode} before answering "
                    f"{self.url}/health; its output:\n{log}"
                )
            try:
                with _DIRECT.open(self.url + "/health", timeout=1.0) as response:
                    if json.load(response).get("pid") == self._process.pid:
                        return
            except (OSError, ValueError):
                pass  # not listening yet, or not our server
            if time.monotonic() > deadline:
                log = self._log_tail()
                self.stop()
                raise RuntimeError(
                    f"sandbox server did not answer {self.url}/health within "
                    f"{self.startup_timeout_s:.0f} s; its output:\n{log}"
                )
            time.sleep(0.1)

    def _log_tail(self, n_bytes: int = 4000) -> str:
        assert self.log_path is not None
        data = self.log_path.read_bytes()
        return data[-n_bytes:].decode("utf-8", errors="replace")

    def stop(self, timeout_s: float = 10.0) -> None:
        process, self._process = self._process, None
        if process is not None and process.poll() is None:
            process.terminate()
            try:
                process.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
        if self._remove_log and self.log_path is not None:
            self.log_path.unlink(missing_ok=True)
            self.log_path, self._remove_log = None, False

    def __enter__(self) -> "SandboxService":
        return self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.stop()


if __name__ == "__main__":
    main()
