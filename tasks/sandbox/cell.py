"""A cell's init process (I) and the program processes (X) it forks, one per call.

I is pid 1 of the cell's pid namespace (see template.py for how it is made). Once: it sets up the
cell's filesystem view and what every program starts with. Then per call: it makes a private
working dir, forks X, enforces the wall-clock limit, kills every other process in the namespace
once X is done (setsid() escapes included: they are in the namespace), removes the dir, and
reports X's wait status on the call's status pipe (tasks/sandbox/protocol.py).

X has its own process group, fd 0/1/2 from the call and every other descriptor closed, a scrubbed
environment, uid nobody (or root without any capability when nobody cannot read the interpreter),
rlimits, fresh seeds, and runs the code through the runner as a fresh interpreter would.

What is left of a small call's cost is mostly copy-on-write faults: every page that X (or I,
after the fork) writes is copied, at ~5 us a fault on a VM. So X does as
little as it can: I sets up once what every program starts with (environment, sys.argv,
sys.path, the standard stream objects, no_new_privs, the rlimits to apply), forks without CPython's after-fork hooks,
and the server sends the program already compiled (marshal) when it can (see
executor.TemplatePool._compiled).
"""

import ctypes
import marshal
import os
import random
import resource
import select
import shutil
import signal
import socket
import sys
import time
import traceback

from tasks.sandbox import protocol, runner
from tasks.sandbox.isolation import (
    NOBODY,
    PR_SET_CHILD_SUBREAPER,
    PR_SET_NO_NEW_PRIVS,
    drop_privileges,
    libc,
    nobody_can_import,
    set_up_filesystem,
)
from tasks.sandbox.limits import apply_rlimits, rlimits
from tasks.sandbox.protocol import END_EXITED, END_KILLED, END_TIMEOUT


def reseed_numpy() -> None:
    # Every call is a fork of the same template: without this, they all draw the same numbers.
    np = sys.modules.get("numpy")
    if np is not None:
        np.random.seed(np.frombuffer(os.urandom(32), dtype=np.uint32))


# ------------------------------------------------------------------------------------------------
# The program (X)


def _read(path: str) -> bytes:
    fd = os.open(path, os.O_RDONLY)
    try:
        chunks = []
        while chunk := os.read(fd, 1 << 20):
            chunks.append(chunk)
        return b"".join(chunks)
    finally:
        os.close(fd)


def _program(req: dict, fds: list[int], drop_to: int | None, rlimit_pairs: list[tuple[int, tuple[int, int]]]) -> None:
    """In X: isolate, run, exit. Never returns. Signal dispositions, the environment, sys.argv,
    sys.path and the (empty) standard stream objects come from I, set as a fresh interpreter
    would have them (see run_init)."""
    try:
        # Our own process group: `os.killpg(0, 9)` must not reach the cell.
        os.setpgid(0, 0)
        stdin_fd = os.open(req["stdin_path"], os.O_RDONLY)
        os.dup2(stdin_fd, 0)
        os.dup2(fds[0], 1)
        os.dup2(fds[1], 2)
        os.closerange(3, 1 << 20)  # the status pipe, the cell's socket, everything inherited
        # Plain reads: a text-mode open() builds a stack of io objects, ~60 page faults.
        source = _read(req["code_path"]).decode("utf-8", errors="replace")
        program = None
        if req.get("compiled_path"):  # compiled by the server: the call skips the compiler
            program = marshal.loads(_read(req["compiled_path"]))
        os.chdir(req["home"])
        drop_privileges(drop_to)
        apply_rlimits(rlimit_pairs)
        code_rc = runner.run(source, program)
    except BaseException:
        try:
            traceback.print_exc()
        except BaseException:
            pass
        code_rc = 1
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except BaseException:
            pass
    os._exit(code_rc)


# ------------------------------------------------------------------------------------------------
# The cell's init (I)


def _await_program(pid: int, sock: socket.socket, req: dict) -> tuple[int, bool]:
    """Wait for X to exit, for the wall-clock limit, or for the server's b"K<call>" (or hang-up).
    Returns (why, whether the server hung up)."""
    pidfd = os.pidfd_open(pid)
    try:
        deadline = time.monotonic() + req["timeout_s"]
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                return END_TIMEOUT, False
            ready, _, _ = select.select([pidfd, sock], [], [], left)
            if pidfd in ready:
                return END_EXITED, False
            if sock in ready:
                message = sock.recv(64)
                if protocol.is_kill(message, req["call"]):
                    return END_KILLED, False
                if not message:
                    return END_KILLED, True
    finally:
        os.close(pidfd)


def _vm_size() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[0]) * resource.getpagesize()


def _children(parent: int) -> list[int]:
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat", "rb") as f:
                    fields = f.read().rsplit(b")", 1)[1].split()
            except OSError:
                continue
            if int(fields[1]) == parent:
                found.append(int(entry))
    return found


def _end_all(program: int, pidns: bool) -> int | None:
    """Kill everything the call started and reap it; X's wait status."""
    if pidns:
        # From a namespace's init, kill(-1) reaches every other process in the namespace, and
        # nothing outside it: setsid() and double-fork escapes included.
        os.kill(-1, signal.SIGKILL)
    else:
        try:
            os.killpg(program, signal.SIGKILL)
        except ProcessLookupError:
            pass
    status = None
    while True:
        try:
            pid, wait_status = os.waitpid(-1, 0)
        except ChildProcessError:
            if pidns:
                break
            # Without a pid namespace, escapes that left X's group are found as our children
            # (we are their subreaper) and killed in rounds.
            rest = _children(os.getpid())
            if not rest:
                break
            for pid in rest:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            continue
        if pid == program:
            status = wait_status
    return status


def _empty(directory: str) -> None:
    for entry in os.scandir(directory):
        if entry.is_dir(follow_symlinks=False):
            shutil.rmtree(entry.path, ignore_errors=True)
        else:
            try:
                os.unlink(entry.path)
            except OSError:
                pass


def run_init(sock: socket.socket, spec: dict, caps: dict) -> None:
    """I's life: set up the cell's view once, then run calls one after another. Never returns."""
    try:
        for sig in (signal.SIGCHLD, signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
            signal.signal(sig, signal.SIG_DFL)
        # As in a fresh interpreter (X inherits it); for I, a closed status pipe is an error
        # to handle, not a reason to die.
        signal.signal(signal.SIGPIPE, signal.SIG_IGN)
        pidns = caps["pidns"]
        if not pidns:
            libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)
        if caps["mountns"]:
            set_up_filesystem(spec["dir"], spec["pool"], spec["package_root"], caps["root"])
        report: dict = {"ready": True}
        drop_to = None
        if caps["root"]:
            ok, bad = nobody_can_import(spec["package_root"])
            report.update(drop_privileges=ok, drop_privileges_blocked_by=bad)
            drop_to = NOBODY if ok else None
        # The programs' rlimits, worked out once here rather than in each X. RLIMIT_NPROC counts
        # every process of the uid, so concurrent calls run as nobody would share it; the cell's
        # pids cgroup, where there is one, is the better cap. RLIMIT_AS counts on top of the
        # template's own mappings: numpy and sympy are already mapped.
        program_uid = os.geteuid() if drop_to is None else drop_to
        rlimit_pairs = rlimits(**spec["limits"], nproc=program_uid != 0 and not spec["cgroup"], address_base=_vm_size())
        shm = "/dev/shm" if caps["mountns"] and os.path.isdir("/dev/shm") else None
        # What every program starts with, set once here rather than in each X: a page X writes
        # costs it a copy-on-write fault (~5 us on a VM), and that is most of a small call's cost.
        sys.argv = [""]
        sys.path = [p for p in sys.path if p not in ("", os.getcwd(), spec["package_root"])]
        _program_streams()
        raw_fork = len(os.listdir("/proc/self/task")) == 1
        # Inherited by every X and irreversible: no setuid binary gives anything back. Set here
        # once, after the set-up above, which needed I's privileges.
        libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0)
        protocol.send_json(sock, report)
        while call := protocol.receive_call(sock):
            req, fds = call
            if not _run_call(sock, req, fds, drop_to, rlimit_pairs, pidns, shm, raw_fork):
                return
    except BaseException:
        traceback.print_exc()
    finally:
        os._exit(0)


def _program_streams() -> None:
    """sys.stdin/stdout/stderr as a fresh interpreter makes them for a program whose stdin is a
    file and whose stdout and stderr are pipes. X inherits them empty (I flushes before each
    fork) over its own fds 0-2. Made while fds 1 and 2 are pipes, so that `seekable()`, which
    the wrappers decide when made, says False as it would for X's pipes; I's own tracebacks
    still reach the server's log through fd 2."""
    sys.stdin = open(0, encoding="utf-8", errors="strict", closefd=False)
    r, w = os.pipe()
    saved = [os.dup(1), os.dup(2)]
    try:
        os.dup2(w, 1)
        os.dup2(w, 2)
        sys.stdout = open(1, "w", encoding="utf-8", closefd=False)
        sys.stderr = open(2, "w", encoding="utf-8", errors="backslashreplace", closefd=False, buffering=1)
    finally:
        os.dup2(saved[0], 1)
        os.dup2(saved[1], 2)
        for fd in (r, w, *saved):
            os.close(fd)
    sys.__stdin__, sys.__stdout__, sys.__stderr__ = sys.stdin, sys.stdout, sys.stderr


_program_env: dict[str, str] = {}  # what I last set os.environ to, for its programs


def _fork(raw: bool) -> int:
    """fork(2) without CPython's after-fork work when the process has one thread: that work
    (thread-state and lock re-initialisation, the `os.register_at_fork` hooks) is only needed
    when other threads existed at the fork, and it costs the child ~200 copy-on-write faults,
    ~0.6 ms. Of the hooks, only `random`'s reseeding matters to a program: I draws the seeds
    before the fork instead (_run_call)."""
    if not raw:
        return os.fork()
    pid = libc.fork()
    if pid < 0:
        errno = ctypes.get_errno()
        raise OSError(errno, os.strerror(errno))
    return pid


def _run_call(
    sock: socket.socket,
    req: dict,
    fds: list[int],
    drop_to: int | None,
    rlimit_pairs: list[tuple[int, tuple[int, int]]],
    pidns: bool,
    shm: str | None,
    raw_fork: bool,
) -> bool:
    """One call in I; False when the server hung up meanwhile."""
    status_w = fds[2]
    home = req["home"]
    try:
        os.mkdir(home, 0o700)
        if drop_to is not None:
            os.chown(home, drop_to, drop_to)
        if req["env"] != _program_env:  # the same for every call of a cell: set it once
            os.environ.clear()
            os.environ.update(req["env"])
            _program_env.clear()
            _program_env.update(req["env"])
        for stream in (sys.stdout, sys.stderr):
            stream.flush()  # X inherits these objects: nothing of I's may be left in them
        # Fresh seeds for X, drawn here: in X the same work costs twice as much (its writes are
        # copy-on-write faults). X is forked without CPython's after-fork hooks (see _fork), so
        # `random` would not reseed itself there, and numpy never does.
        random.seed()
        reseed_numpy()
        try:
            pid = _fork(raw_fork)
        except OSError as exc:
            protocol.write_error(status_w, exc)
            return True
        if pid == 0:
            _program(req, fds, drop_to, rlimit_pairs)
        os.close(fds[0])
        os.close(fds[1])
        why, hung_up = _await_program(pid, sock, req)
        status = _end_all(pid, pidns)
        try:
            os.rmdir(home)  # most programs write no file: this is then all it takes
        except OSError:
            shutil.rmtree(home, ignore_errors=True)
        if shm:
            _empty(shm)
        protocol.write_status(status_w, status, why)
        return not hung_up
    finally:
        for fd in fds:
            try:
                os.close(fd)
            except OSError:
                pass
