"""A call's output and outcome, as the server collects them: stdout and stderr under one byte
budget, the end of the program, and the `ToolResult` they make.

`ProcessCapture` serves the fresh-process path (an asyncio subprocess protocol), `PipeCapture`
the template path (the cell's pipes, read on the event loop, plus its status pipe).
"""

import asyncio
import os
import signal

from tasks.records import ToolResult, ToolStatus
from tasks.sandbox.protocol import parse_status
from tasks.sandbox.runner import EXIT_MEMORY

TRUNCATION_MARKER = "\n...[output truncated]"

# After the program is killed, how long to wait for the pipes to close. Only a process that
# escaped the kill can hold them longer; we then close our ends and move on.
DRAIN_GRACE_S = 1.0


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


class _BudgetedOutput:
    """stdout and stderr under one shared byte budget; the pipe that overflowed it is marked.
    Data past the budget is dropped (the caller keeps reading so the pipes never stall)."""

    def __init__(self, budget: int, fds: tuple[int, int]) -> None:
        self.budget = budget
        self.kept = 0
        self.output = {fd: bytearray() for fd in fds}
        self.stdout_fd, self.stderr_fd = fds
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

    def _decoded(self, fd: int) -> str:
        text = self.output[fd].decode("utf-8", errors="replace")
        return text + TRUNCATION_MARKER if fd == self.overflow_fd else text

    def result(self, returncode: int | None, timed_out: bool, wall_s: float) -> ToolResult:
        return ToolResult(
            status=_classify(returncode, timed_out, self.overflow_fd is not None),
            stdout=self._decoded(self.stdout_fd),
            stderr=self._decoded(self.stderr_fd),
            exit_code=returncode,
            wall_s=round(wall_s, 4),
        )


class ProcessCapture(_BudgetedOutput, asyncio.SubprocessProtocol):
    """Collects a child's stdout and stderr and signals its exit and an overflow.

    A protocol rather than `asyncio.create_subprocess_exec`: its `Process.wait()` also waits for
    the pipes to close, which a background grandchild can delay forever; here process exit is its
    own event.
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


class PipeCapture(_BudgetedOutput):
    """Reads one template call's stdout, stderr (under one byte budget) and status pipe."""

    def __init__(self, loop: asyncio.AbstractEventLoop, out_r: int, err_r: int, status_r: int, budget: int) -> None:
        super().__init__(budget, (out_r, err_r))
        self.loop = loop
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
            report = parse_status(bytes(self.status_buf))
            if report is not None:
                self.error, self.wait_status, self.ending = report
                self._finish()
            return
        self.keep(fd, data)

    def close_all(self) -> None:
        for fd in list(self.open_fds):
            self._close(fd)
