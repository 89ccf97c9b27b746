"""Headless Chromium (Debian's), driven over the DevTools protocol with aiohttp: open a page,
wait until a JavaScript condition holds, take a full-page screenshot."""

import asyncio
import base64
import json
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
import urllib.request
from pathlib import Path

import aiohttp

# No first-run pings, component updates or sync: this machine has no network beyond loopback.
FLAGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def render(url: str, ready_js: str, screenshot: Path, timeout_s: float = 90.0) -> object:
    """The value of `ready_js` once truthy (or at the timeout), after saving a screenshot."""
    chromium = shutil.which("chromium")
    if chromium is None:
        raise RuntimeError("chromium is not installed (`make test` installs Debian's package)")
    port = _free_port()
    # Chromium's helper processes may still write to the profile while they die.
    with tempfile.TemporaryDirectory(ignore_cleanup_errors=True) as profile:
        browser = subprocess.Popen(
            [
                chromium,
                *FLAGS,
                f"--user-data-dir={profile}",
                "--window-size=1400,3600",
                f"--remote-debugging-port={port}",
                "--remote-debugging-address=127.0.0.1",
                "about:blank",
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,
        )
        try:
            return asyncio.run(_drive(port, url, ready_js, screenshot, timeout_s))
        finally:
            os.killpg(browser.pid, signal.SIGKILL)  # the browser and its helper processes
            browser.wait()


async def _drive(port: int, url: str, ready_js: str, screenshot: Path, timeout_s: float) -> object:
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/json", timeout=1) as response:
                page = next(t for t in json.load(response) if t["type"] == "page")
            break
        except (OSError, StopIteration, ValueError):
            if time.monotonic() > deadline:
                raise TimeoutError("chromium's DevTools endpoint never answered") from None
            await asyncio.sleep(0.1)
    async with (
        aiohttp.ClientSession() as session,
        session.ws_connect(page["webSocketDebuggerUrl"], max_msg_size=0) as ws,
    ):
        calls = 0

        async def call(method: str, **params) -> dict:
            nonlocal calls
            calls += 1
            await ws.send_json({"id": calls, "method": method, "params": params})
            async for message in ws:
                data = json.loads(message.data)
                if data.get("id") == calls:
                    return data.get("result", {})
            raise ConnectionError("chromium closed the DevTools socket")

        await call("Page.navigate", url=url)
        value = None
        while time.monotonic() < deadline:
            result = await call("Runtime.evaluate", expression=ready_js, returnByValue=True)
            value = result.get("result", {}).get("value")
            if value:
                break
            await asyncio.sleep(0.5)
        shot = await call("Page.captureScreenshot", format="png", captureBeyondViewport=True)
        screenshot.parent.mkdir(parents=True, exist_ok=True)
        screenshot.write_bytes(base64.b64decode(shot["data"]))
        return value
