"""Run one piece of model-written Python as a fresh, resource-limited program.

Two paths with one contract (a `ToolResult` with a structured status):

- `TemplatePool.run` (what the server uses): each call is forked from a warm "cell", a copy of a
  template process that has numpy and sympy imported and warmed up (tasks/sandbox/zygote.py);
  one cell per worker slot, so one fork per call. Each cell has its own network namespace (no
  network at all), pid namespace (everything a call started, setsid() escapes included, is killed
  when the call ends), mount namespace (private /proc showing only the cell's processes; every
  mount read-only except the cell's work dir and a private /dev/shm; the other cells' files and,
  for uid nobody, everything but the interpreter's import directories hidden) and a pids cgroup
  capped at `Limits.processes` + 3. Per call: uid nobody when running as root (root without
  capabilities when nobody cannot read the interpreter), rlimits, a scrubbed environment, no
  inherited descriptors, and a private working dir removed afterwards. What the kernel refuses
  is logged once at start-up. A dead cell is replaced and a dead template restarted; if the
  template cannot be started, calls fall back to `run_python`.
- `run_python`: a fresh interpreter per call (`python -I`), rlimits, its own session, a private
  temp dir, a scrubbed environment. Slower, and it has none of the namespaces: the program shares
  the server's network and filesystem view and uid, and a setsid() child can outlive its call.

Common to both: a runner parses the code with `ast`, executes it, and echoes the value of a final
bare expression as IPython does; stdout + stderr share a byte budget past which the program is
killed and the output marked truncated; a wall-clock timeout SIGKILLs the whole process group.

Still not covered (use a VM for hostile users): programs share the kernel; uid nobody can read
what the world may read; when uid nobody cannot read the interpreter even after the masking,
programs run as uid 0 without capabilities and can read files that root owns and may read
(e.g. /etc/shadow), though they cannot write anywhere but their working dir; disk use is bounded
per file (RLIMIT_FSIZE), not in total. In the
template path RLIMIT_AS counts on top of the template's own mappings (numpy and sympy are already
mapped; the program gets `memory_mb` more).
"""

import asyncio
import importlib.util
import json
import marshal
import os
import resource
import select
import shutil
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import threading
import time
import warnings
from dataclasses import dataclass, field

from tasks.sandbox.status import ToolResult, ToolStatus
from tasks.sandbox.zygote import END_TIMEOUT, EXIT_MEMORY, compile_program

TRUNCATION_MARKER = "\n...[output truncated]"

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


class _BudgetedOutput:
    """stdout and stderr under one shared byte budget; the pipe that overflowed it is marked.
    Data past the budget is dropped (the caller keeps reading so the pipes never stall)."""

    def __init__(self, budget: int, fds: tuple[int, int]) -> None:
        self.budget = budget
        self.kept = 0
        self.output = {fd: bytearray() for fd in fds}
        self.overflow_fd: int | None = None
        self.stopped = asyncio.Event()  # the program ended or overflowed the budget

    def keep(self, fd: int, data: bytes) -> None:
        room = self.budget - self.kept
        if len(data) > room:
            data = data[:room]
            if self.overflow_fd is None:
                self.overflow_fd = fd
                self.stopped.set()
        self.output[fd] += data
        self.kept += len(data)

    def result(self, returncode: int | None, timed_out: bool, wall_s: float) -> ToolResult:
        """The call's structured result; `text(1)` / `text(2)` are the subclass's stdout / stderr."""
        return ToolResult(
            status=_classify(returncode, timed_out, self.overflow_fd is not None),
            stdout=self.text(1),
            stderr=self.text(2),
            exit_code=returncode,
            wall_s=round(wall_s, 4),
        )

    def decoded(self, fd: int) -> str:
        text = self.output[fd].decode("utf-8", errors="replace")
        return text + TRUNCATION_MARKER if fd == self.overflow_fd else text


class _Capture(_BudgetedOutput, asyncio.SubprocessProtocol):
    """Collects stdout and stderr under one shared byte budget and signals exit and overflow.

    A protocol rather than `asyncio.create_subprocess_exec`: its `Process.wait()` also waits for
    the pipes to close, which a background grandchild can delay forever; here process exit is its
    own event. Data past the budget is read and dropped so the pipes never stall.
    """

    def __init__(self, budget: int) -> None:
        super().__init__(budget, (1, 2))
        self.closed = asyncio.Event()  # exited and every pipe closed: all output is in

    def pipe_data_received(self, fd: int, data: bytes) -> None:
        self.keep(fd, data)

    def process_exited(self) -> None:
        self.stopped.set()

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed.set()

    def text(self, fd: int) -> str:
        return self.decoded(fd)


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
    if returncode == EXIT_MEMORY:
        return ToolStatus.MEMORY
    if returncode is None or returncode < 0:
        return ToolStatus.KILLED
    return ToolStatus.ERROR


def _call_dir(root: str, code: str, stdin: str) -> tuple[str, str, str]:
    """(working dir, code path, stdin path) of a call under its private `root`; the code and the
    input live beside the working directory, not in it."""
    home = os.path.join(root, "home")
    os.mkdir(home)
    code_path = os.path.join(root, "code.py")
    stdin_path = os.path.join(root, "stdin")
    with open(code_path, "w", encoding="utf-8", errors="replace") as f:
        f.write(code)
    with open(stdin_path, "w", encoding="utf-8", errors="replace") as f:
        f.write(stdin)
    return home, code_path, stdin_path


async def run_python(
    code: str, stdin: str, limits: Limits, python: str = sys.executable
) -> ToolResult:
    """Run `code` as a fresh Python program with `stdin` as its standard input."""
    root = tempfile.mkdtemp(prefix="rstar2-sandbox-")
    try:
        home, code_path, stdin_path = _call_dir(root, code, stdin)
        return await _spawn_and_wait(
            [python, "-I", "-B", "-c", _RUNNER, code_path, str(EXIT_MEMORY)],
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

    return capture.result(returncode, timed_out, wall_s)


# ------------------------------------------------------------------------------------------------
# The warm path: calls forked from a pre-loaded template process (see tasks/sandbox/zygote.py).

_PACKAGE_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# How long past the wall-clock limit (which the cell enforces itself) a cell may take to report
# before it counts as stuck and is killed, namespace and all.
_CELL_GRACE_S = 2.0

# Longer programs are compiled in the cell (see TemplatePool._compiled): ~1 ms per 10 KB here.
_COMPILE_HERE_MAX_CHARS = 16_384


class _PipeCall(_BudgetedOutput):
    """Reads one call's stdout, stderr (under one byte budget) and status pipe."""

    def __init__(self, loop: asyncio.AbstractEventLoop, out_r: int, err_r: int, status_r: int,
                 budget: int) -> None:  # fmt: skip
        super().__init__(budget, (out_r, err_r))
        self.loop = loop
        self.names = {out_r: 1, err_r: 2}
        self.status_r = status_r
        self.status_buf = bytearray()
        self.error: str | None = None  # the cell could not start the call
        self.wait_status: int | None = None
        self.ending: int | None = None
        self.finished = asyncio.Event()  # the cell reported (or its status pipe closed)
        self.closed = asyncio.Event()  # both output pipes at EOF
        self.open_fds = {out_r, err_r, status_r}
        for fd in self.open_fds:
            os.set_blocking(fd, False)
            loop.add_reader(fd, self._readable, fd)

    def _close(self, fd: int) -> None:
        if fd in self.open_fds:
            self.open_fds.discard(fd)
            self.loop.remove_reader(fd)
            os.close(fd)
        if not (self.open_fds - {self.status_r}):
            self.closed.set()

    def _finish(self) -> None:
        self.finished.set()
        self.stopped.set()

    def _readable(self, fd: int) -> None:
        try:
            data = os.read(fd, 65536)
        except BlockingIOError:
            return
        except OSError:
            data = b""
        if not data:
            if fd == self.status_r:
                self._finish()
            self._close(fd)
            return
        if fd == self.status_r:
            self.status_buf += data
            buf = self.status_buf
            if buf[:1] == b"E":
                self.error = bytes(buf[1:]).decode("utf-8", errors="replace")
                self._finish()
            elif buf[:1] == b"S" and len(buf) >= 6:
                self.wait_status, self.ending = struct.unpack("<iB", bytes(buf[1:6]))
                self._finish()
            return
        self.keep(fd, data)

    def close_all(self) -> None:
        for fd in list(self.open_fds):
            self._close(fd)

    def text(self, fd_name: int) -> str:
        return self.decoded(next(fd for fd, name in self.names.items() if name == fd_name))


class _Cell:
    """The server's side of one cell (see zygote.py): a socket to its init I, and I's pid."""

    def __init__(self, directory: str, sock: socket.socket, info: dict) -> None:
        self.dir = directory
        self.sock: socket.socket | None = sock
        self.pid = info["pid"]
        self.pidfd = os.pidfd_open(self.pid)  # readable once I has exited; no pid-reuse race
        self.calls = 0

    def alive(self) -> bool:
        if self.sock is None:
            return False
        dead, _, _ = select.select([self.pidfd], [], [], 0)
        return not dead

    def interrupt(self, call: int) -> None:
        if self.sock is not None:
            try:
                self.sock.send(b"K%d" % call)
            except OSError:
                pass  # I is gone: the status pipe says so

    def close(self) -> None:
        """Kill I, which ends its namespace and everything in it."""
        if self.sock is None:
            return
        try:
            signal.pidfd_send_signal(self.pidfd, signal.SIGKILL)
        except ProcessLookupError:
            pass
        os.close(self.pidfd)
        self.sock.close()
        self.sock = None


class TemplatePool:
    """Runs each call in one of `workers` cells forked from a warm template process.

    One per event loop (the server holds one). `run` has the same contract as `run_python`.
    A dead cell is replaced and a dead template restarted; when the template cannot be started,
    calls fall back to `run_python` (a fresh interpreter per call) and the reason is logged once.
    """

    def __init__(self, limits: Limits, workers: int = 4, python: str = sys.executable,
                 log=None, startup_timeout_s: float = 60.0) -> None:  # fmt: skip
        self.limits = limits
        self.workers = workers
        self.python = python
        self.log = log or (lambda line: print(line, file=sys.stderr, flush=True))
        self.startup_timeout_s = startup_timeout_s
        self.process: subprocess.Popen[bytes] | None = None
        self.sock: socket.socket | None = None
        self.report: dict = {}
        self.restarts = 0
        self.cells: list[_Cell | None] = [None] * workers
        self.pool_dir: str | None = None
        self._cgroups: list[str] = []  # every template's cgroup, removed at close()
        self._idle: asyncio.Queue[int] | None = None
        self._starting: asyncio.Lock | None = None
        self._template_lock = threading.Lock()  # one cell request to the template at a time
        self._logged_privileges = False

    # -- template and cell lifecycle -------------------------------------------------------------

    def _spawn_template(self) -> None:
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        env = {
            "PATH": os.environ.get("PATH", os.defpath),
            "LANG": "C.UTF-8",
            "OMP_NUM_THREADS": "1",
            "OPENBLAS_NUM_THREADS": "1",
            "MKL_NUM_THREADS": "1",
            "PYTHONDONTWRITEBYTECODE": "1",
            # Objects in glibc's heap, and that heap in transparent huge pages: forking the
            # template then copies one page-table entry per 2 MiB instead of per 4 KiB
            # (measured: 4.8 -> 1.5 ms CPU per fork + exit, and fewer page faults after it).
            "PYTHONMALLOC": "malloc",
            "GLIBC_TUNABLES": "glibc.malloc.hugetlb=1",
        }
        try:
            self.process = subprocess.Popen(
                [self.python, "-B", "-m", "tasks.sandbox.zygote", str(theirs.fileno()),
                 str(self.workers), str(self.limits.processes)],  # fmt: skip
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
                stderr=None,  # tracebacks from the template go to the server's log
                cwd=_PACKAGE_ROOT,
                env=env,
                pass_fds=(theirs.fileno(),),
            )
        finally:
            theirs.close()
        ours.settimeout(self.startup_timeout_s)
        try:
            report = json.loads(ours.recv(1 << 16) or b"{}")
        except (OSError, ValueError) as exc:
            ours.close()
            self._kill_template()
            raise RuntimeError(f"sandbox template did not start: {exc}") from None
        if not report.get("ready"):
            ours.close()
            self._kill_template()
            raise RuntimeError("sandbox template exited during start-up")
        self.sock, self.report = ours, report
        if report.get("pids_cgroup"):
            self._cgroups.append(report["pids_cgroup"])
        if self.pool_dir is None:
            # Readable by uid nobody, which runs the programs; each cell sees only its own subdir.
            self.pool_dir = tempfile.mkdtemp(prefix="rstar2-sandbox-")
            os.chmod(self.pool_dir, 0o755)
        self._log_report(report)

    def _make_cell(self, index: int) -> _Cell:
        """Ask the template for a new cell in slot `index` (blocking: run it in a thread)."""
        assert self.sock is not None and self.pool_dir is not None
        directory = os.path.join(self.pool_dir, f"cell-{index}")
        shutil.rmtree(directory, ignore_errors=True)
        os.makedirs(os.path.join(directory, "work"))
        for path in (directory, os.path.join(directory, "work")):
            os.chmod(path, 0o755)
        spec = {"dir": directory, "pool": self.pool_dir, "package_root": _PACKAGE_ROOT}
        with self._template_lock:
            self.sock.settimeout(self.startup_timeout_s)
            try:
                self.sock.send(json.dumps(spec).encode())
                message, fds, _, _ = socket.recv_fds(self.sock, 1 << 16, 1)
            finally:
                self.sock.settimeout(None)
        if not message:
            raise RuntimeError("sandbox template closed its socket")
        info = json.loads(message)
        if "error" in info or len(fds) != 1:
            for fd in fds:
                os.close(fd)
            raise RuntimeError(f"sandbox template could not start a cell: {info.get('error')}")
        sock = socket.socket(fileno=fds[0])
        sock.settimeout(self.startup_timeout_s)
        try:
            ready = json.loads(sock.recv(1 << 16) or b"{}")
        except (OSError, ValueError):
            ready = {}
        if not ready.get("ready"):
            sock.close()
            raise RuntimeError("sandbox cell died while starting (see the log above)")
        sock.setblocking(False)
        self.report.update({k: v for k, v in ready.items() if k != "ready"})
        if not self._logged_privileges:
            self._logged_privileges = True
            self._log_privileges(self.report)
        return _Cell(directory, sock, info)

    def _log_report(self, r: dict) -> None:
        self.log(f"sandbox template pid {r.get('pid')} ready (numpy, sympy pre-loaded)")
        self.log(
            "sandbox isolation: network "
            + ("none for programs (own empty network namespace per cell)" if r.get("netns") else
               "NOT ISOLATED: the kernel refused unshare(CLONE_NEWNET); "
               "programs can reach the network")  # fmt: skip
        )
        self.log(
            "sandbox isolation: pid namespace "
            + ("on (escaped background processes die with the call)" if r.get("pidns") else
               "NOT available: escapes are hunted as children of the cell (subreaper)")
            + ("; private /proc, read-only mounts" if r.get("mountns") else
               "; host /proc visible, host mounts writable where the uid may write")
        )  # fmt: skip
        if r.get("root"):
            self.log(
                f"sandbox isolation: pids cgroup {r.get('pids_cgroup')}"
                if r.get("pids_cgroup") else
                "sandbox isolation: no pids cgroup: a fork bomb run as root is bounded only by "
                "the wall-clock kill"  # fmt: skip
            )

    def _log_privileges(self, r: dict) -> None:
        if not r.get("root"):
            return
        if r.get("drop_privileges"):
            self.log("sandbox isolation: running as root; programs run as nobody (65534)")
        else:
            self.log(
                "sandbox isolation: running as root and NOT dropping privileges: uid nobody "
                f"cannot read the interpreter's files ({r.get('drop_privileges_blocked_by')}); "
                "programs run as uid 0 without capabilities, on read-only mounts"
            )

    def _kill_template(self) -> None:
        process, self.process = self.process, None
        if self.sock is not None:
            self.sock.close()
            self.sock = None
        if process is not None:
            if process.poll() is None:
                process.kill()
            process.wait()

    async def start(self) -> None:
        await asyncio.get_running_loop().run_in_executor(None, self._spawn_template)

    async def start_cells(self) -> None:
        """Start every missing cell now rather than on its first call (~50 ms each)."""
        loop = asyncio.get_running_loop()
        for index, cell in enumerate(self.cells):
            if cell is None:
                self.cells[index] = await loop.run_in_executor(None, self._make_cell, index)

    def close(self) -> None:
        for i, cell in enumerate(self.cells):
            if cell is not None:
                cell.close()
                self.cells[i] = None
        self._kill_template()
        for cgroup in self._cgroups:
            _remove_cgroup(cgroup)
        self._cgroups = []
        if self.pool_dir is not None:
            shutil.rmtree(self.pool_dir, ignore_errors=True)
            self.pool_dir = None
        self.report = {}

    def alive(self) -> bool:
        return self.process is not None and self.process.poll() is None and self.sock is not None

    async def _ensure(self) -> bool:
        if self.alive():
            return True
        if self._starting is None:
            self._starting = asyncio.Lock()
        async with self._starting:
            if self.alive():
                return True
            if self.process is not None:
                self.log(f"sandbox template died (exit {self.process.poll()}); restarting it")
                self.restarts += 1
            self._kill_template()
            try:
                await self.start()
                return True
            except (OSError, RuntimeError) as exc:
                self.log(f"sandbox template could not start ({exc}); falling back to one fresh "
                         "interpreter per call")  # fmt: skip
                return False

    # -- one call --------------------------------------------------------------------------------

    async def run(self, code: str, stdin: str) -> ToolResult:
        if not await self._ensure():
            return await run_python(code, stdin, self.limits, self.python)
        if self._idle is None:
            self._idle = asyncio.Queue()
            for index in range(self.workers):
                self._idle.put_nowait(index)
        index = await self._idle.get()
        try:
            for _ in range(2):
                cell = self.cells[index]
                if cell is None or not cell.alive():
                    if cell is not None:
                        self.log("sandbox cell died; starting a new one")
                        cell.close()
                    self.cells[index] = None
                    if not await self._ensure():
                        return await run_python(code, stdin, self.limits, self.python)
                    loop = asyncio.get_running_loop()
                    try:
                        cell = await loop.run_in_executor(None, self._make_cell, index)
                    except (OSError, RuntimeError, ValueError) as exc:
                        return ToolResult(ToolStatus.INTERNAL, stderr=f"sandbox: {exc}")
                    self.cells[index] = cell
                result = await self._run_in(cell, code, stdin)
                if result is not None:
                    return result
                cell.close()  # it died under the call: a new cell, and the call once more
            return ToolResult(ToolStatus.INTERNAL, stderr="sandbox cells keep dying")
        finally:
            self._idle.put_nowait(index)

    def _compiled(self, code: str) -> bytes | None:
        """The program compiled here, marshalled, for the cell to load instead of compiling it:
        the compiler's allocations would cost the call ~150 copy-on-write faults (~1 ms) in its
        forked process, and nothing here. None, and the cell compiles, when the template's
        bytecode differs from ours, when the code is long (compiling must not stall the event
        loop), or when compiling fails or warns: the program must report that itself."""
        if self.report.get("magic") != importlib.util.MAGIC_NUMBER.hex():
            return None
        if len(code) > _COMPILE_HERE_MAX_CHARS:
            return None
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            try:
                return marshal.dumps(compile_program(code))
            except (SyntaxError, ValueError, Warning, RecursionError, MemoryError):
                return None

    async def _run_in(self, cell: _Cell, code: str, stdin: str) -> ToolResult | None:
        """The call's result, or None when the cell died before reporting."""
        limits = self.limits
        assert cell.sock is not None
        code_path = os.path.join(cell.dir, "code.py")
        stdin_path = os.path.join(cell.dir, "stdin")
        compiled_path = os.path.join(cell.dir, "code.marshal")
        with open(code_path, "w", encoding="utf-8", errors="replace") as f:
            f.write(code)
        with open(stdin_path, "w", encoding="utf-8", errors="replace") as f:
            f.write(stdin)
        compiled = self._compiled(code)
        if compiled is not None:
            with open(compiled_path, "wb") as f:
                f.write(compiled)
        home = os.path.join(cell.dir, "work", "home")
        cell.calls += 1
        request = {
            "call": cell.calls,
            "home": home,
            "code_path": code_path,
            "compiled_path": compiled_path if compiled is not None else None,
            "stdin_path": stdin_path,
            "env": _environment(home),
            "timeout_s": limits.timeout_s,
            "limits": {
                f: getattr(limits, f)
                for f in ("cpu_s", "memory_mb", "file_size_mb", "open_files", "processes")
            },
        }
        out_r, out_w = os.pipe()
        err_r, err_w = os.pipe()
        status_r, status_w = os.pipe()
        started = time.monotonic()
        try:
            socket.send_fds(cell.sock, [json.dumps(request).encode()], [out_w, err_w, status_w])
        except OSError:
            for fd in (out_r, out_w, err_r, err_w, status_r, status_w):
                os.close(fd)
            return None
        for fd in (out_w, err_w, status_w):
            os.close(fd)
        call = _PipeCall(asyncio.get_running_loop(), out_r, err_r, status_r, limits.output_bytes)
        stuck = False
        try:
            try:
                await asyncio.wait_for(call.stopped.wait(), limits.timeout_s + _CELL_GRACE_S)
            except TimeoutError:
                pass
            if not call.finished.is_set():
                cell.interrupt(cell.calls)  # too much output, or the cell is late
                try:
                    await asyncio.wait_for(call.finished.wait(), _CELL_GRACE_S)
                except TimeoutError:
                    stuck = True
                    cell.close()
            wall_s = time.monotonic() - started
            try:
                await asyncio.wait_for(call.closed.wait(), _DRAIN_GRACE_S)
            except TimeoutError:
                pass
        except BaseException:
            cell.interrupt(cell.calls)  # cancelled: the program must not run on
            raise
        finally:
            call.close_all()
        if call.error is not None:
            return ToolResult(ToolStatus.INTERNAL, stderr=f"sandbox could not start the call: "
                                                          f"{call.error}")  # fmt: skip
        if call.wait_status is None and not stuck:
            return None
        returncode = None
        if call.wait_status is not None and call.wait_status >= 0:
            returncode = os.waitstatus_to_exitcode(call.wait_status)
        timed_out = stuck or call.ending == END_TIMEOUT
        return call.result(returncode, timed_out, wall_s)


def _remove_cgroup(path: str) -> None:
    """Remove a template's cgroup once its cells' processes are gone (they die asynchronously)."""
    for _ in range(50):
        for entry in os.scandir(path) if os.path.isdir(path) else ():
            if entry.is_dir():
                try:
                    os.rmdir(entry.path)
                except OSError:
                    pass
        try:
            os.rmdir(path)
            return
        except FileNotFoundError:
            return
        except OSError:
            time.sleep(0.02)
