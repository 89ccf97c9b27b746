"""The fresh-process path: each call is a new interpreter (`python -I`) running the runner.

Slower than the template path (executor.TemplatePool), and it has none of the namespaces: the
program shares the server's network and filesystem view and uid, and a setsid() child can
outlive its call. It keeps the rlimits, its own session (killed as a group), a private temp dir
and a scrubbed environment. The template path falls back to it when its template cannot start.
"""

import asyncio
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time

from tasks.records import ToolResult, ToolStatus
from tasks.sandbox import runner
from tasks.sandbox.capture import DRAIN_GRACE_S, ProcessCapture
from tasks.sandbox.limits import Limits, apply_rlimits, rlimits


def program_environment(home: str) -> dict[str, str]:
    """The whole environment of a program, on both paths."""
    # Nothing from the server's environment leaks in (tokens, keys, proxy settings).
    return {
        "PATH": os.environ.get("PATH", os.defpath),
        "LANG": "C.UTF-8",
        "HOME": home,
        "TMPDIR": home,  # so tempfile users also write into the directory we remove
        "PYTHONDONTWRITEBYTECODE": "1",  # for nested interpreters; -I ignores PYTHON* here
        "OMP_NUM_THREADS": "1",
        "OPENBLAS_NUM_THREADS": "1",
    }


def write_inputs(directory: str, code: str, stdin: str) -> tuple[str, str]:
    """(code path, stdin path) of a call, written into `directory`: beside the program's working
    directory, not in it."""
    code_path = os.path.join(directory, "code.py")
    stdin_path = os.path.join(directory, "stdin")
    with open(code_path, "w", encoding="utf-8", errors="replace") as f:
        f.write(code)
    with open(stdin_path, "w", encoding="utf-8", errors="replace") as f:
        f.write(stdin)
    return code_path, stdin_path


def _kill_group(pgid: int) -> None:
    try:
        os.killpg(pgid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass  # the group is already empty


async def run_python(code: str, stdin: str, limits: Limits, python: str = sys.executable) -> ToolResult:
    """Run `code` as a fresh Python program with `stdin` as its standard input."""
    root = tempfile.mkdtemp(prefix="rstar2-sandbox-")
    try:
        home = os.path.join(root, "home")
        os.mkdir(home)
        code_path, stdin_path = write_inputs(root, code, stdin)
        return await _spawn_and_wait([python, "-I", "-B", runner.__file__, code_path], stdin_path, home, limits)
    finally:
        shutil.rmtree(root, ignore_errors=True)


async def _spawn_and_wait(argv: list[str], stdin_path: str, home: str, limits: Limits) -> ToolResult:
    # Computed here, clamped to what the server holds; the child only applies them.
    pairs = rlimits(**limits.rlimit_fields(), nproc=os.geteuid() != 0)
    loop = asyncio.get_running_loop()
    started = time.monotonic()
    try:
        with open(stdin_path, "rb") as stdin_file:
            transport, capture = await loop.subprocess_exec(
                lambda: ProcessCapture(limits.output_bytes),
                *argv,
                stdin=stdin_file,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                cwd=home,
                env=program_environment(home),
                preexec_fn=lambda: apply_rlimits(pairs),  # in the child, between fork and exec
                start_new_session=True,
                close_fds=True,
            )
    except (OSError, subprocess.SubprocessError) as exc:
        return ToolResult(ToolStatus.INTERNAL, stderr=f"sandbox could not start the program: {exc}")

    timed_out = False
    try:
        try:
            await asyncio.wait_for(capture.stopped.wait(), limits.timeout_s)
        except TimeoutError:
            timed_out = True
        finally:
            wall_s = time.monotonic() - started
            # Always kill the group: it ends a runaway, it reaps background children that would
            # otherwise keep our pipes open after a normal exit, and it covers cancellation.
            _kill_group(transport.get_pid())
        try:
            await asyncio.wait_for(capture.closed.wait(), DRAIN_GRACE_S)
        except TimeoutError:
            pass  # a process outside the group holds a pipe; closing the transport drops it
        returncode = transport.get_returncode()
    finally:
        transport.close()

    return capture.result(returncode, timed_out, wall_s)
