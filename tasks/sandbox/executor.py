"""Run one piece of model-written Python as a fresh, resource-limited program.

Each call gets its own interpreter (`python -I`), a private temporary directory as cwd and HOME
(removed afterwards), a scrubbed environment, rlimits (CPU, address space, file size, open files,
and processes when not root), its own session so that a wall-clock timeout can SIGKILL the whole
process group, and a byte budget on stdout + stderr. A small runner script parses the code with
`ast`, executes it, and echoes the value of a final bare expression as IPython does.

What is not covered (use a container or a VM for untrusted users):
- no network isolation and no filesystem isolation beyond the working directory: the code runs with
  the server's uid and can read what that uid can read;
- a child that calls `os.setsid()` leaves the process group and survives the group kill; the CPU
  rlimit (inherited) bounds its CPU time, nothing bounds its sleeping;
- RLIMIT_NPROC counts every process and thread of the uid, so it is skipped when running as root;
- disk use is bounded per file (RLIMIT_FSIZE), not in total.
"""

import asyncio
import os
import resource
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field

from tasks.sandbox.status import ToolResult, ToolStatus

TRUNCATION_MARKER = "\n...[output truncated]"

# The runner exits with this code when the user's code dies of MemoryError, so the status comes
# from the runner's own report, never from parsing the user's output. Chosen to collide with no
# common convention (1 = exception, 2 = usage, 120 = flush failure, 128+n = shell signal).
_EXIT_MEMORY = 86

# After the group kill, how long to wait for the pipes to close. Only a process that escaped the
# group (setsid) can hold them longer; we then close our ends and move on.
_DRAIN_GRACE_S = 1.0

_RUNNER = """
import ast, linecache, sys, traceback, types

def _report(exc):
    # Skip the runner's frame: the model should see only frames from its own code.
    tb = exc.__traceback__.tb_next if exc.__traceback__ is not None else None
    traceback.print_exception(type(exc), exc, tb)

def _run(path, exit_memory):
    with open(path, encoding="utf-8") as f:
        source = f.read()
    filename = "<code>"
    # Registering the source lets tracebacks quote the offending lines.
    linecache.cache[filename] = (len(source), None, source.splitlines(True), filename)
    try:
        tree = ast.parse(source, filename)
        last = None
        if tree.body and isinstance(tree.body[-1], ast.Expr):
            last = compile(ast.Expression(tree.body.pop().value), filename, "eval")
        body = compile(tree, filename, "exec")
    except (SyntaxError, ValueError) as exc:  # ValueError: null bytes in the source
        sys.stderr.write("".join(traceback.format_exception_only(type(exc), exc)))
        return 1
    # A fresh __main__ so that pickling (multiprocessing) finds the user's functions.
    main = types.ModuleType("__main__")
    sys.modules["__main__"] = main
    try:
        exec(body, main.__dict__)
        if last is not None:
            value = eval(last, main.__dict__)
            if value is not None:
                print(repr(value))
    except MemoryError as exc:
        main.__dict__.clear()  # free the user's data: formatting the report needs memory
        try:
            _report(exc)
        except MemoryError:
            pass
        return exit_memory
    except Exception as exc:
        _report(exc)
        return 1
    return 0

path, exit_memory = sys.argv[1], int(sys.argv[2])
del sys.argv[1:]
sys.exit(_run(path, exit_memory))
"""


@dataclass(frozen=True)
class Limits:
    timeout_s: float = field(default=4.0, metadata={"help": "wall-clock limit per call (s)"})
    cpu_s: int = field(default=4, metadata={"help": "CPU-time limit per call (s), RLIMIT_CPU"})
    memory_mb: int = field(default=512, metadata={"help": "address-space limit (MiB), RLIMIT_AS"})
    output_bytes: int = field(
        default=4096, metadata={"help": "stdout + stderr kept; more kills the program"}
    )
    file_size_mb: int = field(default=8, metadata={"help": "largest file the code may write (MiB)"})
    open_files: int = field(default=64, metadata={"help": "open file descriptors, RLIMIT_NOFILE"})
    processes: int = field(
        default=32, metadata={"help": "RLIMIT_NPROC for the uid (skipped when root)"}
    )


def _rlimits(limits: Limits) -> list[tuple[int, tuple[int, int]]]:
    """The (resource, (soft, hard)) pairs to apply, clamped to the hard limits we hold now:
    asking for more than that fails setrlimit in the child and with it the whole spawn."""
    wanted = [
        # The soft CPU limit sends SIGXCPU (reported as a timeout); the hard one is the backstop.
        (resource.RLIMIT_CPU, limits.cpu_s, limits.cpu_s + 1),
        (resource.RLIMIT_AS, limits.memory_mb << 20, limits.memory_mb << 20),
        (resource.RLIMIT_FSIZE, limits.file_size_mb << 20, limits.file_size_mb << 20),
        (resource.RLIMIT_NOFILE, limits.open_files, limits.open_files),
    ]
    if os.geteuid() != 0:
        # Root ignores RLIMIT_NPROC, and for other uids it counts all their processes and threads.
        wanted.append((resource.RLIMIT_NPROC, limits.processes, limits.processes))
    pairs = []
    for which, soft, hard in wanted:
        _, held = resource.getrlimit(which)
        if held != resource.RLIM_INFINITY:
            soft, hard = min(soft, held), min(hard, held)
        pairs.append((which, (soft, hard)))
    return pairs


def _environment(home: str) -> dict[str, str]:
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


class _Capture(asyncio.SubprocessProtocol):
    """Collects stdout and stderr under one shared byte budget and signals exit and overflow.

    A protocol rather than `asyncio.create_subprocess_exec`: its `Process.wait()` also waits for
    the pipes to close, which a background grandchild can delay forever; here process exit is its
    own event. Data past the budget is read and dropped so the pipes never stall.
    """

    def __init__(self, budget: int) -> None:
        self.budget = budget
        self.kept = 0
        self.output = {1: bytearray(), 2: bytearray()}
        self.overflow_fd: int | None = None
        self.stopped = asyncio.Event()  # the program exited or overflowed the budget
        self.closed = asyncio.Event()  # exited and every pipe closed: all output is in

    def pipe_data_received(self, fd: int, data: bytes) -> None:
        room = self.budget - self.kept
        if len(data) > room:
            data = data[:room]
            if self.overflow_fd is None:
                self.overflow_fd = fd
                self.stopped.set()
        self.output[fd] += data
        self.kept += len(data)

    def process_exited(self) -> None:
        self.stopped.set()

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed.set()

    def text(self, fd: int) -> str:
        text = self.output[fd].decode("utf-8", errors="replace")
        return text + TRUNCATION_MARKER if fd == self.overflow_fd else text


def _kill_group(pgid: int) -> None:
    try:
        os.killpg(pgid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass  # the group is already empty


def _classify(returncode: int | None, timed_out: bool, overflowed: bool) -> ToolStatus:
    if overflowed:
        return ToolStatus.OUTPUT_LIMIT
    if timed_out or returncode == -signal.SIGXCPU:
        return ToolStatus.TIMEOUT
    if returncode == 0:
        return ToolStatus.OK
    if returncode == _EXIT_MEMORY:
        return ToolStatus.MEMORY
    if returncode is None or returncode < 0:
        return ToolStatus.KILLED
    return ToolStatus.ERROR


async def run_python(
    code: str, stdin: str, limits: Limits, python: str = sys.executable
) -> ToolResult:
    """Run `code` as a fresh Python program with `stdin` as its standard input."""
    root = tempfile.mkdtemp(prefix="rstar2-sandbox-")
    try:
        # The code and the input live beside the working directory, not in it.
        home = os.path.join(root, "home")
        os.mkdir(home)
        code_path = os.path.join(root, "code.py")
        stdin_path = os.path.join(root, "stdin")
        with open(code_path, "w", encoding="utf-8", errors="replace") as f:
            f.write(code)
        with open(stdin_path, "w", encoding="utf-8", errors="replace") as f:
            f.write(stdin)
        return await _spawn_and_wait(
            [python, "-I", "-B", "-c", _RUNNER, code_path, str(_EXIT_MEMORY)],
            stdin_path,
            home,
            limits,
        )
    finally:
        shutil.rmtree(root, ignore_errors=True)


async def _spawn_and_wait(
    argv: list[str], stdin_path: str, home: str, limits: Limits
) -> ToolResult:
    rlimits = _rlimits(limits)

    def apply_rlimits() -> None:  # runs in the child between fork and exec
        for which, pair in rlimits:
            resource.setrlimit(which, pair)

    loop = asyncio.get_running_loop()
    started = time.monotonic()
    try:
        with open(stdin_path, "rb") as stdin_file:
            transport, capture = await loop.subprocess_exec(
                lambda: _Capture(limits.output_bytes),
                *argv,
                stdin=stdin_file,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                cwd=home,
                env=_environment(home),
                preexec_fn=apply_rlimits,
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
            await asyncio.wait_for(capture.closed.wait(), _DRAIN_GRACE_S)
        except TimeoutError:
            pass  # a process outside the group holds a pipe; closing the transport drops it
        returncode = transport.get_returncode()
    finally:
        transport.close()

    return ToolResult(
        status=_classify(returncode, timed_out, capture.overflow_fd is not None),
        stdout=capture.text(1),
        stderr=capture.text(2),
        exit_code=returncode,
        wall_s=round(wall_s, 4),
    )
