"""Shared by the sandbox test files: a service started with a secret in its environment (which
sandboxed programs must not see), and a one-call client."""

import asyncio
import os
from collections.abc import Iterator
from contextlib import contextmanager

from tasks.records import ToolResult
from tasks.sandbox.client import SandboxClient
from tasks.sandbox.executor import Limits
from tasks.sandbox.server import SandboxService


@contextmanager
def service_with_secret(limits: Limits, secret_name: str, secret_value: str) -> Iterator[SandboxService]:
    # The server inherits the secret; the sandboxed programs must not.
    os.environ[secret_name] = secret_value
    try:
        sandbox = SandboxService(workers=2, limits=limits).start()
    finally:
        del os.environ[secret_name]
    try:
        yield sandbox
    finally:
        sandbox.stop()


def execute(url: str, code: str, stdin: str = "") -> ToolResult:
    async def go() -> ToolResult:
        async with SandboxClient([url], timeout_s=60) as client:
            return await client.execute(code, stdin)

    return asyncio.run(go())
