"""The sandbox's HTTP application: admission control, execution and counters.

    POST /execute        {"code": str, "input": str}          -> ToolResult.to_dict()
    POST /execute_batch  {"requests": [{"code", "input"}...]} -> {"results": [...]}, same order
    GET  /health                                               -> {"status": "ok", "pid": int}
    GET  /stats          in flight, done, rejected, counts by status, latency p50/p99

With a credential (`token`; the server reads it from $RSTAR2_SANDBOX_TOKEN), every call but
/health must carry `Authorization: Bearer <token>`; one without it is answered 401 before its body
is read, and nothing runs. A request body larger than MAX_BODY_BYTES is answered 413.

At most `workers` programs run at once; at most `max_queue` more calls wait for a slot. Past that
the server answers 503 {"error": "busy"} at once, so an overloaded sandbox pushes back on its
callers instead of growing an unbounded queue (the client retries 503 with a backoff).

Calls are forked from a warm template process (numpy, sympy pre-loaded; see executor.py);
`--spawn` starts a fresh interpreter per call instead. The isolation the kernel allowed is
logged at start-up, one line per layer.
"""

import asyncio
import collections
import hmac
import os
import time
from typing import Any

from aiohttp import web

from tasks.records import ToolResult
from tasks.sandbox.executor import TemplatePool
from tasks.sandbox.fresh import run_python
from tasks.sandbox.limits import Limits

# Batches of long programs are large; aiohttp's default cap is 1 MiB.
MAX_BODY_BYTES = 64 << 20
TOKEN_ENV = "RSTAR2_SANDBOX_TOKEN"


class _BadRequest(Exception):
    pass


def _require(token: str):
    """Middleware: every route but /health needs the credential (compared in constant time)."""
    expected = f"Bearer {token}".encode()

    @web.middleware
    async def check(request: web.Request, handler):
        if request.path != "/health":
            given = request.headers.get("Authorization", "").encode()
            if not hmac.compare_digest(given, expected):
                return web.json_response({"error": "this sandbox needs its run's credential"}, status=401)
        return await handler(request)

    return check


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

    def __init__(self, workers: int, max_queue: int, limits: Limits, latency_window: int, template: bool) -> None:
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
            raise web.HTTPServiceUnavailable(text='{"error": "busy"}', content_type="application/json")
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
                "template": None
                if self.pool is None
                else {
                    "alive": self.pool.alive(),
                    "restarts": self.pool.restarts,
                    **self.pool.report,
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
    token: str | None = None,
) -> web.Application:
    """`template`: fork calls from a warm pre-loaded process (else one fresh interpreter each);
    `token`: the credential every call must carry (None: none needed)."""
    sandbox = _Sandbox(workers, max_queue, limits, latency_window, template)
    app = web.Application(client_max_size=MAX_BODY_BYTES, middlewares=[_require(token)] if token else [])
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
