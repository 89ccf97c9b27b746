"""Async client for one or more sandbox replicas.

Each request goes to the replica with the fewest calls in flight from this client (least-requests
balancing; the release's round-robin piles work onto a replica that is stuck on slow programs).
A request is retried only when it got no answer because it never reached a server (connection
refused or reset) or the server pushed back with 503 busy; a call that got an answer, even an
HTTP error, is never run again, and a request that timed out is not retried because the server
may still be running it. When the retries run out the call comes back as
`ToolStatus.INTERNAL` instead of raising, so one outage cannot crash a whole rollout batch.

A replica that refused or dropped a connection is passed over for `down_s`; with `resolve`
(replica index -> its URL now, blocking; None while it is not up) the client asks, off its event
loop, where the replica came back (a restarted replica listens on a new port) and sends to it
again from then on. When no replica has answered for `outage_timeout_s`, a call raises
`SandboxOutage` instead: the replicas are not coming back where they were (their node is gone
and nothing else can hold them), and the attempt should stop with that said, not train on calls
that all came back `internal`.

The aiohttp session is bound to the event loop it was created in: use one client per loop.
`ToolRunner` runs one on a loop of its own, for callers that are not async (the agent loop).
"""

from __future__ import annotations

import asyncio
import random
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from typing import Any

import aiohttp

from tasks.records import ToolResult, ToolStatus


class _Unavailable(Exception):
    """The call got no usable answer; the message says why."""


class SandboxOutage(RuntimeError):
    """No replica has answered for longer than the client's `outage_timeout_s`."""


class SandboxRefused(RuntimeError):
    """A replica refused the run's credential: every call would be refused, so the attempt stops
    rather than train on calls that all came back `internal`."""


class SandboxClient:
    def __init__(
        self,
        urls: list[str],
        retries: int = 3,
        timeout_s: float = 120.0,
        batch_size: int = 64,
        backoff_s: float = 0.1,
        down_s: float = 2.0,
        resolve: Callable[[int], str | None] | None = None,
        outage_timeout_s: float = 300.0,
        token: str | None = None,
    ) -> None:
        """`timeout_s` bounds one HTTP request, queueing on the server included; `batch_size` is
        the most calls sent in one /execute_batch request (the paper's workers batch up to 64)."""
        if not urls:
            raise ValueError("SandboxClient needs at least one sandbox URL")
        self.urls = [url.rstrip("/") for url in urls]
        self.retries = retries
        self.timeout_s = timeout_s
        self.batch_size = batch_size
        self.backoff_s = backoff_s
        self.down_s = down_s
        self.resolve = resolve
        self.outage_timeout_s = outage_timeout_s
        self._headers = {"Authorization": f"Bearer {token}"} if token else {}
        self._failing_since: list[float | None] = [None] * len(self.urls)  # first failure since it last answered
        self.retried = 0  # attempts beyond each call's first: what outages cost
        self._down_until = [0.0] * len(self.urls)
        self._finding: dict[int, asyncio.Task] = {}  # replica -> the task asking where it is now
        self._in_flight = [0] * len(self.urls)  # calls, not requests: a batch of 64 weighs 64
        self._turn = 0  # rotates ties so that equal replicas share the load
        self._session: aiohttp.ClientSession | None = None

    async def __aenter__(self) -> SandboxClient:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()

    async def close(self) -> None:
        for task in self._finding.values():
            task.cancel()
        if self._session is not None:
            await self._session.close()
            self._session = None

    def _get_session(self) -> aiohttp.ClientSession:
        if self._session is None:
            self._session = aiohttp.ClientSession(
                timeout=aiohttp.ClientTimeout(total=self.timeout_s),
                # No client-side connection cap: the server's bounded queue is the backpressure,
                # and a pool limit here would be a hidden second queue eating into timeout_s.
                connector=aiohttp.TCPConnector(limit=0),
                headers=self._headers,
            )
        return self._session

    async def execute(self, code: str, input: str = "") -> ToolResult:
        try:
            answer = await self._post("/execute", {"code": code, "input": input}, n_calls=1)
            return ToolResult.from_dict(answer)
        except _Unavailable as exc:
            return _unavailable(str(exc))
        except (KeyError, TypeError, ValueError) as exc:
            return _unavailable(f"malformed answer from the sandbox: {exc!r}")

    async def execute_batch(self, calls: Sequence[tuple[str, str]]) -> list[ToolResult]:
        """Results in the order of `calls`; chunks of `batch_size` go out concurrently."""
        chunks = [calls[i : i + self.batch_size] for i in range(0, len(calls), self.batch_size)]
        answers = await asyncio.gather(*(self._execute_chunk(chunk) for chunk in chunks))
        return [result for chunk_results in answers for result in chunk_results]

    async def _execute_chunk(self, calls: Sequence[tuple[str, str]]) -> list[ToolResult]:
        payload = {"requests": [{"code": code, "input": stdin} for code, stdin in calls]}
        try:
            answer = await self._post("/execute_batch", payload, n_calls=len(calls))
            results = [ToolResult.from_dict(d) for d in answer["results"]]
            if len(results) != len(calls):
                raise ValueError(f"{len(results)} results for {len(calls)} calls")
            return results
        except _Unavailable as exc:
            return [_unavailable(str(exc)) for _ in calls]
        except (KeyError, TypeError, ValueError) as exc:
            return [_unavailable(f"malformed answer from the sandbox: {exc!r}") for _ in calls]

    def _pick(self, failed: set[int]) -> int:
        """The least-loaded replica, preferring ones that have not failed this call yet and are
        not marked down."""
        n, now = len(self.urls), time.monotonic()
        self._turn = (self._turn + 1) % n
        return min(
            range(n),
            key=lambda i: (i in failed, self._down_until[i] > now, self._in_flight[i], (i - self._turn) % n),
        )

    def passed_over(self, replica: int) -> bool:
        """Whether calls avoid the replica now (it failed lately and has not been found since)."""
        return self._down_until[replica] > time.monotonic() or replica in self._finding

    def _mark_down(self, replica: int) -> None:
        now = time.monotonic()
        self._down_until[replica] = now + self.down_s
        if self._failing_since[replica] is None:
            self._failing_since[replica] = now
        if all(since is not None and now - since > self.outage_timeout_s for since in self._failing_since):
            raise SandboxOutage(
                f"no sandbox replica has answered for over {self.outage_timeout_s:.0f} s ({', '.join(self.urls)}): "
                "they are not coming back where they were"
            )
        if self.resolve is not None and replica not in self._finding:
            self._finding[replica] = asyncio.get_running_loop().create_task(self._find(replica))

    async def _find(self, replica: int) -> None:
        """Ask where the replica is until it answers: the same URL (it was busy, or never
        left) or a restarted replica's new one."""
        try:
            while (url := await asyncio.get_running_loop().run_in_executor(None, self.resolve, replica)) is None:
                await asyncio.sleep(self.down_s)
            self.urls[replica] = url.rstrip("/")
            self._down_until[replica] = 0.0
        finally:
            del self._finding[replica]

    async def _post(self, path: str, payload: dict[str, Any], n_calls: int) -> Any:
        session = self._get_session()
        failed: set[int] = set()
        reason = ""
        for attempt in range(self.retries + 1):
            if attempt:
                self.retried += 1
                # Exponential backoff with jitter, so that callers turned away together do not
                # come back together.
                await asyncio.sleep(self.backoff_s * 2 ** (attempt - 1) * random.uniform(0.5, 1.5))
            replica = self._pick(failed)
            url = self.urls[replica] + path
            self._in_flight[replica] += n_calls
            try:
                async with session.post(url, json=payload) as response:
                    if response.status == 401:
                        raise SandboxRefused(
                            f"{url} refused the call (HTTP 401): the run's credential is missing or wrong"
                        )
                    if response.status == 503:
                        reason = f"{url} busy (HTTP 503)"
                        failed.add(replica)
                        continue
                    if response.status != 200:
                        detail = (await response.text())[:500]
                        raise _Unavailable(f"{url} answered HTTP {response.status}: {detail}")
                    self._failing_since[replica] = None
                    return await response.json()
            except TimeoutError:
                raise _Unavailable(f"{url} gave no answer within {self.timeout_s} s") from None
            except aiohttp.ClientConnectionError as exc:
                reason = f"{url}: {type(exc).__name__}: {exc}"
                failed.add(replica)
                self._mark_down(replica)
            except aiohttp.ClientError as exc:
                raise _Unavailable(f"{url}: {type(exc).__name__}: {exc}") from None
            finally:
                self._in_flight[replica] -= n_calls
        raise _Unavailable(f"{reason} (after {self.retries + 1} attempts)")


def _unavailable(reason: str) -> ToolResult:
    return ToolResult(status=ToolStatus.INTERNAL, stderr=f"sandbox unavailable: {reason}")


class ToolRunner:
    """Runs the async sandbox client on a loop of its own, so the sync engine loop can poll."""

    def __init__(
        self,
        urls: list[str],
        resolve: Callable[[int], str | None] | None = None,
        outage_timeout_s: float = 300.0,
        token: str | None = None,
    ):
        """`resolve`, `outage_timeout_s` and `token`: as SandboxClient takes them."""
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="tool-runner", daemon=True)
        self._thread.start()
        self.client = SandboxClient(urls, resolve=resolve, outage_timeout_s=outage_timeout_s, token=token)
        self.submitted = 0  # tool calls sent so far

    def submit(self, code: str, stdin: str) -> Future:
        self.submitted += 1
        return asyncio.run_coroutine_threadsafe(self.client.execute(code, stdin), self._loop)

    def close(self) -> None:
        asyncio.run_coroutine_threadsafe(self.client.close(), self._loop).result(timeout=10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=10)

    def __enter__(self) -> ToolRunner:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
