"""Run one piece of model-written Python as a fresh, resource-limited program.

Two paths with one contract (a `ToolResult` with a structured status):

- `TemplatePool.run` (here; what the server uses): each call is forked from a warm "cell", a copy
  of a template process with numpy and sympy imported and warmed up (template.py, cell.py), one
  cell per worker slot. Each cell has its own network namespace (no network), pid namespace
  (everything a call started, setsid() escapes included, dies with the call), mount namespace
  (private /proc; all read-only but the cell's work dir and /dev/shm; other cells' files and, for
  uid nobody, all but the interpreter's import directories hidden) and a pids cgroup capped at
  `Limits.processes` + 3 (isolation.py). Per call: uid nobody when running as root, rlimits, a
  scrubbed environment, no inherited descriptors, a private working dir removed afterwards. What
  the kernel refuses is logged at start-up. A dead cell is replaced, a dead template restarted;
  without a template, calls fall back to `run_python`.
- `run_python` (fresh.py): a fresh interpreter per call, with rlimits and a scrubbed environment
  but none of the namespaces.

Common to both: the runner (runner.py) executes the code and echoes a final bare expression as
IPython does; rlimits come from `Limits` (limits.py); stdout + stderr share a byte budget past
which the program is killed and its output marked truncated (capture.py); a wall-clock timeout
kills the program and everything it started.

Still not covered (use a VM for hostile users): programs share the kernel; uid nobody can read
what the world may read; when nobody cannot read the interpreter, programs run as uid 0 without
capabilities and can read what root may (e.g. /etc/shadow), though they write only to their
working dir; disk use is bounded per file (RLIMIT_FSIZE), not in total. In the template path
RLIMIT_AS counts on top of the template's own mappings (the program gets `memory_mb` more).
"""

import asyncio
import importlib.util
import marshal
import os
import select
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import warnings

from tasks.records import ToolResult, ToolStatus
from tasks.sandbox import protocol
from tasks.sandbox.capture import DRAIN_GRACE_S, TRUNCATION_MARKER, PipeCapture
from tasks.sandbox.fresh import program_environment, run_python, write_inputs
from tasks.sandbox.isolation import describe_isolation, describe_privileges, remove_pool_cgroup
from tasks.sandbox.limits import Limits
from tasks.sandbox.runner import compile_program

# What callers (the server, benches and tests) import from here, wherever it is defined.
__all__ = ["TRUNCATION_MARKER", "Limits", "TemplatePool", "run_python"]

_PACKAGE_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# How long past the wall-clock limit (which the cell enforces itself) a cell may take to report
# before it counts as stuck and is killed, namespace and all.
_CELL_GRACE_S = 2.0

# Longer programs are compiled in the cell (see TemplatePool._compiled): ~1 ms per 10 KB here.
_COMPILE_HERE_MAX_CHARS = 16_384


class _Cell:
    """The server's side of one cell (see cell.py): a socket to its init I, and I's pid."""

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
                self.sock.send(protocol.kill_message(call))
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

    def __init__(
        self, limits: Limits, workers: int = 4, python: str = sys.executable, log=None, startup_timeout_s: float = 60.0
    ) -> None:
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
        args = [str(theirs.fileno()), str(self.workers), str(self.limits.processes)]
        try:
            self.process = subprocess.Popen(
                [self.python, "-B", "-m", "tasks.sandbox.template", *args],
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
            report = protocol.receive_json(ours)
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
        for line in describe_isolation(report):
            self.log(line)

    def _make_cell(self, index: int) -> _Cell:
        """Ask the template for a new cell in slot `index` (blocking: run it in a thread)."""
        assert self.sock is not None and self.pool_dir is not None
        directory = os.path.join(self.pool_dir, f"cell-{index}")
        shutil.rmtree(directory, ignore_errors=True)
        os.makedirs(os.path.join(directory, "work"))
        for path in (directory, os.path.join(directory, "work")):
            os.chmod(path, 0o755)
        spec = {
            "dir": directory,
            "pool": self.pool_dir,
            "package_root": _PACKAGE_ROOT,
            "limits": self.limits.rlimit_fields(),
        }
        with self._template_lock:
            self.sock.settimeout(self.startup_timeout_s)
            try:
                info, fds = protocol.request_cell(self.sock, spec)
            finally:
                self.sock.settimeout(None)
        if info is None:
            raise RuntimeError("sandbox template closed its socket")
        if "error" in info or len(fds) != 1:
            for fd in fds:
                os.close(fd)
            raise RuntimeError(f"sandbox template could not start a cell: {info.get('error')}")
        sock = socket.socket(fileno=fds[0])
        sock.settimeout(self.startup_timeout_s)
        try:
            ready = protocol.receive_json(sock)
        except (OSError, ValueError):
            ready = {}
        if not ready.get("ready"):
            sock.close()
            raise RuntimeError("sandbox cell died while starting (see the log above)")
        sock.setblocking(False)
        self.report.update({k: v for k, v in ready.items() if k != "ready"})
        if not self._logged_privileges:
            self._logged_privileges = True
            for line in describe_privileges(self.report):
                self.log(line)
        return _Cell(directory, sock, info)

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
            remove_pool_cgroup(cgroup)
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
                self.log(f"sandbox template could not start ({exc}); falling back to one fresh interpreter per call")
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
        code_path, stdin_path = write_inputs(cell.dir, code, stdin)
        compiled_path = os.path.join(cell.dir, "code.marshal")
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
            "env": program_environment(home),
            "timeout_s": limits.timeout_s,
        }
        out_r, out_w = os.pipe()
        err_r, err_w = os.pipe()
        status_r, status_w = os.pipe()
        started = time.monotonic()
        try:
            protocol.send_call(cell.sock, request, [out_w, err_w, status_w])
        except OSError:
            for fd in (out_r, out_w, err_r, err_w, status_r, status_w):
                os.close(fd)
            return None
        for fd in (out_w, err_w, status_w):
            os.close(fd)
        call = PipeCapture(asyncio.get_running_loop(), out_r, err_r, status_r, limits.output_bytes)
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
                await asyncio.wait_for(call.closed.wait(), DRAIN_GRACE_S)
            except TimeoutError:
                pass
        except BaseException:
            cell.interrupt(cell.calls)  # cancelled: the program must not run on
            raise
        finally:
            call.close_all()
        if call.error is not None:
            return ToolResult(ToolStatus.INTERNAL, stderr=f"sandbox could not start the call: {call.error}")
        if call.wait_status is None and not stuck:
            return None
        returncode = None
        if call.wait_status is not None and call.wait_status >= 0:
            returncode = os.waitstatus_to_exitcode(call.wait_status)
        timed_out = stuck or call.ending == protocol.END_TIMEOUT
        return call.result(returncode, timed_out, wall_s)
