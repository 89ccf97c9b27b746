"""Checks that what a test started is gone, by pid (never by name)."""

import json
import os
import time
from pathlib import Path


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def wait_gone(pids: list[int], timeout_s: float = 30.0) -> list[int]:
    """The pids still alive after up to `timeout_s` (an empty list: all gone)."""
    deadline = time.monotonic() + timeout_s
    while (left := [pid for pid in pids if alive(pid)]) and time.monotonic() < deadline:
        time.sleep(0.5)
    return left


def placed_pids(run_dir: Path) -> list[int]:
    """The processes of a run's actors (and of the sandbox servers they started), from the
    placement the run recorded."""
    actors = json.loads((run_dir / "placement.json").read_text())["actors"]
    return [a["pid"] for a in actors] + [a["server_pid"] for a in actors if "server_pid" in a]
