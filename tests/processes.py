"""Checks that what a test started is gone, by pid (never by name)."""

import json
import os
import time
from collections.abc import Callable
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


def descendants(pid: int) -> list[int]:
    """Every process below `pid` now (Ray's head processes, actors, sandbox servers, cells)."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(entry.name))
    found, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def placed_pids(run_dir: Path) -> list[int]:
    """The processes of a run's actors (and of the sandbox servers they started), from the
    placement the run recorded."""
    actors = json.loads((run_dir / "placement.json").read_text())["actors"]
    return [a["pid"] for a in actors] + [a["server_pid"] for a in actors if "server_pid" in a]


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process so far (Linux /proc)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def wait_busy(pid: int, timeout_s: float = 300.0, window_s: float = 0.2, share: float = 0.3) -> None:
    """Return once the process spends at least `share` of a core over a `window_s` window (an
    engine generating, a rank stepping); raise TimeoutError after `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    before = cpu_seconds(pid)
    while time.monotonic() < deadline:
        time.sleep(window_s)
        now = cpu_seconds(pid)
        if now - before >= share * window_s:
            return
        before = now
    raise TimeoutError(f"process {pid} never got busy within {timeout_s} s")


def wait_until(condition: Callable[[], bool], what: str, timeout_s: float = 600.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what} never happened within {timeout_s:.0f} s")
        time.sleep(0.02)


def wait_for(path: Path, timeout_s: float = 600.0) -> None:
    wait_until(path.exists, f"{path} appearing", timeout_s)
