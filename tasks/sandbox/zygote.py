"""The template (zygote) process and its cells: numpy and sympy imported once, one fork per call.

The server starts this module as a child process (T) and talks to it over a SOCK_SEQPACKET Unix
socket. T imports and warms up the heavy modules, then serves one kind of request: "start a
cell". A cell is a long-lived copy of T in its own namespaces, one per worker slot:

    T --fork--> C: unshare(net, pid, mount namespaces where allowed); joins the cell's pids cgroup;
                   forks I, reports I's pid to T, then only waits for I.
    C --fork--> I: pid 1 of the new pid namespace. Once: mounts its own /proc, hides the other
                   cells' files and what uid nobody could not read anyway behind empty tmpfs,
                   makes every mount read-only except the cell's work dir and a private /dev/shm.
                   Then per call: makes a private working dir, forks the program X, enforces the
                   wall-clock limit, kills every other process in the namespace once X is done
                   (setsid() escapes included: they are in the namespace), removes the dir, and
                   writes X's wait status on the call's status pipe.
    I --fork--> X: the program. Its own process group, fd 0/1/2 from the call and every other
                   descriptor closed, scrubbed environment, uid nobody (or root without any
                   capability when nobody cannot read the interpreter), rlimits, fresh seeds;
                   runs the code with the final bare expression echoed, as a fresh interpreter
                   would.

T answers a cell request with I's pid and the server's end of a socket pair to I (SCM_RIGHTS).
The server then sends each call straight to an idle cell: a JSON header plus three descriptors,
the write ends of the call's stdout, stderr and status pipes; b"K<call number>" on the same
socket asks I to kill that call (the server saw too much output, or I is late).

So each call costs one fork of the loaded interpreter and no namespace set-up: creating and
tearing down net, pid and mount namespaces per call cost ~4 ms of CPU, and a second fork of the
loaded template per call ~3 ms more (measured on a 2-core VM, where every page fault is dear).
Namespaces are shared by the calls of one cell one after another, never at once, and nothing of
a call survives it: its processes are killed, its directory and /dev/shm emptied.

What is left of a small call's cost is mostly copy-on-write faults: every page that X (or I,
after the fork) writes is copied, at ~5 us a fault on a VM. So X does as little as it can: I
sets up once what every program starts with (environment, sys.argv, sys.path, the standard
stream objects, no_new_privs), forks without CPython's after-fork hooks, and the server sends
the program already compiled (marshal) when it can (see executor.TemplatePool._compiled).

The first message T sends is a JSON report of what isolation the kernel allowed; the server logs
it, and each cell's readiness report the same way.
"""

import ast
import ctypes
import gc
import importlib.util
import json
import linecache
import marshal
import os
import random
import resource
import select
import shutil
import signal
import socket
import stat
import struct
import sys
import time
import traceback
import types

# Loaded once here, shared copy-on-write by every call.
PRELOAD = ("math", "itertools", "fractions", "functools", "collections", "decimal", "re",
           "statistics", "json", "string", "heapq", "bisect", "random", "cmath",
           "numpy", "sympy")  # fmt: skip

CLONE_NEWNS = 0x00020000
CLONE_NEWPID = 0x20000000
CLONE_NEWNET = 0x40000000
MS_REC = 0x4000
MS_PRIVATE = 1 << 18
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC = 1, 2, 4, 8
MS_REMOUNT, MS_BIND = 32, 4096
PR_SET_CHILD_SUBREAPER = 36
PR_SET_NO_NEW_PRIVS = 38

# A program that dies of MemoryError exits with this code (here and in executor's runner), so the
# status comes from the runner's own report, never from parsing the program's output. Chosen to
# collide with no common convention (1 = exception, 2 = usage, 120 = flush failure, 128+n =
# shell signal).
EXIT_MEMORY = 86
PROGRAM_FILENAME = "<code>"
NOBODY = 65534

_libc = ctypes.CDLL(None, use_errno=True)


def _unshare(flags: int) -> bool:
    return _libc.unshare(ctypes.c_int(flags)) == 0


def _mount(
    source: bytes | None, target: bytes, fstype: bytes | None, flags: int, data: bytes | None = None
) -> bool:
    return _libc.mount(source, target, fstype, ctypes.c_ulong(flags), data) == 0


def _probe(flags: int) -> bool:
    """Whether a child can unshare these namespaces (checked once, in a throwaway child)."""
    pid = os.fork()
    if pid == 0:
        os._exit(0 if _unshare(flags) else 1)
    _, status = os.waitpid(pid, 0)
    return os.waitstatus_to_exitcode(status) == 0


def _write(path: str, text: str) -> None:
    with open(path, "w") as f:
        f.write(text)


def _make_pids_cgroup(name: str, limit: int) -> str | None:
    """A pids cgroup capped at `limit` tasks, or None where there is no writable pids hierarchy:
    a fork bomb run as root, which RLIMIT_NPROC does not stop, hits this cap instead."""
    for base in ("/sys/fs/cgroup/pids", "/sys/fs/cgroup/unified", "/sys/fs/cgroup"):
        if not os.path.exists(os.path.join(base, "cgroup.procs")):
            continue
        path = os.path.join(base, name)
        try:
            os.mkdir(path)
            _write(os.path.join(path, "pids.max"), str(limit))
            return path
        except OSError:
            try:
                os.rmdir(path)
            except OSError:
                pass
    return None


# ------------------------------------------------------------------------------------------------
# Filesystem view of a cell (run in I, inside its own mount namespace, before any call)


def _blocked_for_nobody(path: str) -> str | None:
    """The first directory on the way to `path` (or `path` itself) that uid nobody cannot enter."""
    current = "/"
    for part in [p for p in path.split("/") if p]:
        current = os.path.join(current, part)
        mode = os.stat(current).st_mode
        if stat.S_ISDIR(mode) and not mode & stat.S_IXOTH:
            return current
    return None


def _mask(hidden: str, keep: list[str]) -> None:
    """Cover directory `hidden` with an empty tmpfs in which only the `keep` paths (below it)
    reappear, bind-mounted from the originals."""
    handles = [(path, os.open(path, os.O_PATH)) for path in keep]
    _mount(b"tmpfs", os.fsencode(hidden), b"tmpfs", MS_NOSUID | MS_NODEV, b"mode=0755,size=64k")
    for path, fd in handles:
        os.makedirs(path, mode=0o755, exist_ok=True)
        _mount(os.fsencode(f"/proc/self/fd/{fd}"), os.fsencode(path), None, MS_BIND | MS_REC)
        os.close(fd)


def _readable_imports(package_root: str) -> list[str]:
    """The directories a program imports from (the interpreter's and the environment's)."""
    dirs = {p for p in sys.path if p and os.path.isdir(p) and p != package_root}
    # Only the outermost: a bind of lib/python3.11 already brings lib-dynload along.
    return sorted(d for d in dirs if not any(d != o and d.startswith(o + "/") for o in dirs))


def _lock_down_mounts(writable: list[str]) -> None:
    """Every mount read-only except `writable`, so that even a program running as root cannot
    write outside them (it has no capabilities left to remount)."""
    for path in writable:
        path_b = os.fsencode(path)
        _mount(path_b, path_b, None, MS_BIND)
    with open("/proc/self/mountinfo", "rb") as f:
        lines = f.read().splitlines()
    keep = {os.fsencode(p) for p in writable} | {b"/proc"}
    for line in lines:
        parts = line.split()
        target = parts[4].replace(b"\\040", b" ").replace(b"\\011", b"\t")
        if target in keep:
            continue
        options = set(parts[5].split(b","))
        flags = MS_REMOUNT | MS_BIND | MS_RDONLY
        for name, bit in ((b"nosuid", MS_NOSUID), (b"nodev", MS_NODEV), (b"noexec", MS_NOEXEC)):
            if name in options:
                flags |= bit
        _mount(None, target, None, flags)


def _set_up_filesystem(cell_dir: str, pool_dir: str, package_root: str, nobody: bool) -> None:
    # Private propagation first, so that nothing done here leaks back to the host.
    _mount(None, b"/", None, MS_REC | MS_PRIVATE)
    _mount(b"proc", b"/proc", b"proc", MS_NOSUID | MS_NODEV | MS_NOEXEC)
    _mount(b"/proc/sys", b"/proc/sys", None, MS_BIND | MS_REC)
    _mount(b"/proc/sysrq-trigger", b"/proc/sysrq-trigger", None, MS_BIND)
    # The other cells' code and input are not this cell's business.
    _mask(pool_dir, [cell_dir])
    if nobody:
        # e.g. an interpreter under /root (0700): show nobody just the import directories, and
        # nothing else of the blocking directory (root's home stays hidden).
        blocked: dict[str, list[str]] = {}
        for path in _readable_imports(package_root):
            top = _blocked_for_nobody(path)
            if top is not None:
                blocked.setdefault(top, []).append(path)
        for top, keep in blocked.items():
            _mask(top, keep)
    writable = [os.path.join(cell_dir, "work")]
    _lock_down_mounts(writable)
    if os.path.isdir("/dev/shm"):
        # multiprocessing's locks and queues need a writable /dev/shm: a small private one,
        # emptied after every call.
        _mount(b"tmpfs", b"/dev/shm", b"tmpfs", MS_NOSUID | MS_NODEV,
               b"size=64m,nr_inodes=4096,mode=1777")  # fmt: skip


def _nobody_can_import(package_root: str) -> tuple[bool, str]:
    """Whether uid nobody can read the import directories (imports after the drop)."""
    dirs = _readable_imports(package_root)
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(r)
        try:
            os.setgroups([])
            os.setgid(NOBODY)
            os.setuid(NOBODY)
            bad = [d for d in dirs if not os.access(d, os.R_OK | os.X_OK)]
            os.write(w, json.dumps(bad).encode())
        except OSError as exc:
            os.write(w, json.dumps([f"setuid failed: {exc}"]).encode())
        os._exit(0)
    os.close(w)
    data = b""
    while chunk := os.read(r, 65536):
        data += chunk
    os.close(r)
    os.waitpid(pid, 0)
    bad = json.loads(data or b'["probe failed"]')
    return (not bad), ", ".join(bad)


# ------------------------------------------------------------------------------------------------
# The program's side (X)


def compile_program(source: str) -> tuple[types.CodeType, types.CodeType | None]:
    """The program's body and its final bare expression (echoed, IPython style), compiled as a
    fresh `python` would compile a script. Raises SyntaxError or ValueError (null bytes)."""
    tree = ast.parse(source, PROGRAM_FILENAME)
    last = None
    if tree.body and isinstance(tree.body[-1], ast.Expr):
        last = compile(ast.Expression(tree.body.pop().value), PROGRAM_FILENAME, "eval",
                       dont_inherit=True)  # fmt: skip
    return compile(tree, PROGRAM_FILENAME, "exec", dont_inherit=True), last


def _report(exc: BaseException, source: str) -> None:
    # Registered only now: tracebacks quote the offending lines, and a call that succeeds should
    # not pay for it.
    linecache.cache[PROGRAM_FILENAME] = (
        len(source), None, source.splitlines(True), PROGRAM_FILENAME
    )
    tb = exc.__traceback__.tb_next if exc.__traceback__ is not None else None
    traceback.print_exception(type(exc), exc, tb)


def _execute(program: tuple[types.CodeType, types.CodeType | None], source: str) -> int:
    """Run the compiled program as __main__, echo a final bare expression, return the exit code."""
    body, last = program
    main = types.ModuleType("__main__")
    main.__dict__["__builtins__"] = __builtins__
    sys.modules["__main__"] = main
    try:
        exec(body, main.__dict__)
        if last is not None:
            value = eval(last, main.__dict__)
            if value is not None:
                print(repr(value))
    except MemoryError as exc:
        main.__dict__.clear()
        try:
            _report(exc, source)
        except MemoryError:
            pass
        return EXIT_MEMORY
    except SystemExit as exc:
        code = exc.code
        if code is None:
            return 0
        if isinstance(code, int):
            return code & 0xFF
        try:
            print(code, file=sys.stderr)
        except Exception:
            pass
        return 1
    except BaseException as exc:  # KeyboardInterrupt too: the program failed
        _report(exc, source)
        return 1
    return 0


def _warm_up() -> None:
    """Run the common math once: sympy and numpy load submodules and build tables lazily on
    first use (the first `factor` in a process costs ~100 ms), and every call would pay again."""
    try:
        import numpy as np
        import sympy

        x, y = sympy.symbols("x y")
        sympy.factor(x**6 - y**6 + 2 * x**3 - 2 * y**3)
        sympy.expand((x + y) ** 5)
        sympy.simplify(sympy.sin(x) ** 2 + sympy.cos(x) ** 2)
        sympy.solve([x**2 - 2 * y, x + y - 1], [x, y])
        sympy.integrate(x * sympy.exp(x), x)
        sympy.limit(sympy.sin(x) / x, x, 0)
        sympy.series(sympy.exp(x), x, 0, 4)
        sympy.Matrix([[1, 2], [3, 4]]).inv()
        sympy.factorint(2**32 + 1), sympy.isprime(97), sympy.nsimplify(0.75), sympy.sqrt(8)
        sympy.N(sympy.pi, 30), sympy.binomial(10, 3), sympy.Rational(1, 3) + 1
        str(x**2 / 3), sympy.latex(x**2)
        np.linalg.solve(np.eye(3), np.ones(3)), np.fft.fft(np.ones(8)), np.random.rand(3)
    except Exception:
        traceback.print_exc()


def _reseed_numpy() -> None:
    # Every call is a fork of the same template: without this, they all draw the same numbers.
    np = sys.modules.get("numpy")
    if np is not None:
        np.random.seed(np.frombuffer(os.urandom(32), dtype=np.uint32))


def _drop_capabilities() -> None:
    """Root without capabilities: no remounting, no new namespaces, no raw sockets, no ptrace of
    strangers; files are still checked against uid 0's own permission bits (hence the read-only
    mounts). Also for any program it execs (empty bounding set; no_new_privs comes from I)."""
    for cap in range(64):
        _libc.prctl(24, cap, 0, 0, 0)  # PR_CAPBSET_DROP; EINVAL past the last cap is fine
    header = (ctypes.c_uint32 * 2)(0x20080522, 0)  # _LINUX_CAPABILITY_VERSION_3, this thread
    data = (ctypes.c_uint32 * 6)()  # effective, permitted, inheritable x 2 words: all zero
    _libc.capset(header, data)


def _vm_size() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[0]) * resource.getpagesize()


def _read(path: str) -> bytes:
    fd = os.open(path, os.O_RDONLY)
    try:
        chunks = []
        while chunk := os.read(fd, 1 << 20):
            chunks.append(chunk)
        return b"".join(chunks)
    finally:
        os.close(fd)


def _program(req: dict, fds: list[int], drop_to: int | None, vm_base: int,
             cgroup: bool) -> None:  # fmt: skip
    """In X: isolate, run, exit. Never returns. Signal dispositions, the environment, sys.argv,
    sys.path and the (empty) standard stream objects come from I, set as a fresh interpreter
    would have them (see _cell)."""
    code_rc = 1
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
        if drop_to is not None:
            os.setgroups([])
            os.setgid(drop_to)
            os.setuid(drop_to)
        if os.geteuid() == 0:
            _drop_capabilities()
        lim = req["limits"]
        nproc = ((resource.RLIMIT_NPROC, lim["processes"], lim["processes"]),)
        for which, soft, hard in (
            (resource.RLIMIT_CPU, lim["cpu_s"], lim["cpu_s"] + 1),
            # On top of the pre-loaded template: numpy and sympy are already mapped.
            (resource.RLIMIT_AS, vm_base + (lim["memory_mb"] << 20),
             vm_base + (lim["memory_mb"] << 20)),  # fmt: skip
            (resource.RLIMIT_FSIZE, lim["file_size_mb"] << 20, lim["file_size_mb"] << 20),
            (resource.RLIMIT_NOFILE, lim["open_files"], lim["open_files"]),
        # RLIMIT_NPROC counts every process of the uid, so concurrent calls run as nobody would
        # share it; the cell's pids cgroup, where there is one, is the better cap.
        ) + (nproc if os.geteuid() and not cgroup else ()):
            _, held = resource.getrlimit(which)
            if held != resource.RLIM_INFINITY:
                soft, hard = min(soft, held), min(hard, held)
            resource.setrlimit(which, (soft, hard))
        if program is None:
            try:
                program = compile_program(source)
            except (SyntaxError, ValueError) as exc:
                sys.stderr.write("".join(traceback.format_exception_only(type(exc), exc)))
        code_rc = 1 if program is None else _execute(program, source)
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

END_EXITED, END_TIMEOUT, END_KILLED = 0, 1, 2  # why a call ended, sent after its wait status


def _await_program(pid: int, sock: socket.socket, req: dict) -> tuple[int, bool]:
    """Wait for X to exit, for the wall-clock limit, or for the server's b"K<call>" (or hang-up).
    Returns (why, whether the server hung up)."""
    timeout_s = req["timeout_s"]
    kill = b"K%d" % req["call"]
    pidfd = os.pidfd_open(pid)
    try:
        deadline = time.monotonic() + timeout_s
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                return END_TIMEOUT, False
            ready, _, _ = select.select([pidfd, sock], [], [], left)
            if pidfd in ready:
                return END_EXITED, False
            if sock in ready:
                message = sock.recv(64)
                if message == kill:
                    return END_KILLED, False
                if not message:
                    return END_KILLED, True
    finally:
        os.close(pidfd)


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


def _cell(sock: socket.socket, spec: dict, caps: dict) -> None:
    """I's life: set up the cell's view once, then run calls one after another. Never returns."""
    try:
        for sig in (signal.SIGCHLD, signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
            signal.signal(sig, signal.SIG_DFL)
        # As in a fresh interpreter (X inherits it); for I, a closed status pipe is an error
        # to handle, not a reason to die.
        signal.signal(signal.SIGPIPE, signal.SIG_IGN)
        pidns = caps["pidns"]
        if not pidns:
            _libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)
        if caps["mountns"]:
            _set_up_filesystem(spec["dir"], spec["pool"], spec["package_root"], caps["root"])
        report: dict = {"ready": True}
        drop_to = None
        if caps["root"]:
            ok, bad = _nobody_can_import(spec["package_root"])
            report.update(drop_privileges=ok, drop_privileges_blocked_by=bad)
            drop_to = NOBODY if ok else None
        vm_base = _vm_size()
        shm = "/dev/shm" if caps["mountns"] and os.path.isdir("/dev/shm") else None
        # What every program starts with, set once here rather than in each X: a page X writes
        # costs it a copy-on-write fault (~5 us on a VM), and that is most of a small call's cost.
        sys.argv = [""]
        sys.path = [p for p in sys.path if p not in ("", os.getcwd(), spec["package_root"])]
        _program_streams()
        raw_fork = len(os.listdir("/proc/self/task")) == 1
        # Inherited by every X and irreversible: no setuid binary gives anything back. Set here
        # once, after the set-up above, which needed I's privileges.
        _libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0)
        sock.send(json.dumps(report).encode())
        while True:
            message, fds, _, _ = socket.recv_fds(sock, 1 << 16, 8)
            if not message:
                return  # the server is gone
            if message.startswith(b"K") or len(fds) != 3:
                for fd in fds:
                    os.close(fd)
                continue  # a kill that arrived after its call ended
            if not _run_call(sock, json.loads(message), fds, drop_to, vm_base, pidns, shm,
                             bool(spec.get("cgroup")), raw_fork):  # fmt: skip
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
    sys.stdin = open(0, "r", encoding="utf-8", errors="strict", closefd=False)
    r, w = os.pipe()
    saved = [os.dup(1), os.dup(2)]
    try:
        os.dup2(w, 1)
        os.dup2(w, 2)
        sys.stdout = open(1, "w", encoding="utf-8", closefd=False)
        sys.stderr = open(2, "w", encoding="utf-8", errors="backslashreplace", closefd=False,
                          buffering=1)  # fmt: skip
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
    pid = _libc.fork()
    if pid < 0:
        errno = ctypes.get_errno()
        raise OSError(errno, os.strerror(errno))
    return pid


def _run_call(sock: socket.socket, req: dict, fds: list[int], drop_to: int | None, vm_base: int,
              pidns: bool, shm: str | None, cgroup: bool, raw_fork: bool) -> bool:  # fmt: skip
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
        _reseed_numpy()
        try:
            pid = _fork(raw_fork)
        except OSError as exc:
            os.write(status_w, b"E" + f"{type(exc).__name__}: {exc}".encode()[:200])
            return True
        if pid == 0:
            _program(req, fds, drop_to, vm_base, cgroup)
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
        os.write(status_w, b"S" + struct.pack("<iB", -1 if status is None else status, why))
        return not hung_up
    finally:
        for fd in fds:
            try:
                os.close(fd)
            except OSError:
                pass


# ------------------------------------------------------------------------------------------------
# The template (T)


def _start_cell(spec: dict, caps: dict, processes: int) -> tuple[dict, socket.socket]:
    """Fork C, which makes the namespaces and forks I; returns pids and the server's socket."""
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    r, w = os.pipe()
    cell_pid = os.fork()
    if cell_pid == 0:
        try:
            ours.close()
            os.close(r)
            signal.signal(signal.SIGCHLD, signal.SIG_DFL)
            pool_cgroup = caps.get("pids_cgroup")
            if pool_cgroup:
                # C, I, X and what X starts: one cap per cell, so that one call's fork bomb
                # cannot starve the other cells.
                mine = os.path.join(pool_cgroup, f"cell-{os.getpid()}")
                os.mkdir(mine)
                _write(os.path.join(mine, "pids.max"), str(processes + 3))
                _write(os.path.join(mine, "cgroup.procs"), str(os.getpid()))
            flags = CLONE_NEWNET if caps["netns"] else 0
            flags |= CLONE_NEWPID if caps["pidns"] else 0
            flags |= CLONE_NEWNS if caps["mountns"] else 0
            if flags:
                _unshare(flags)
            init = os.fork()
            if init == 0:
                os.close(w)
                _cell(theirs, {**spec, "cgroup": pool_cgroup}, caps)
            theirs.close()
            os.write(w, struct.pack("<q", init))
            os.close(w)
            while True:
                try:
                    os.waitpid(init, 0)
                    break
                except InterruptedError:
                    continue
        except BaseException:
            traceback.print_exc()
        finally:
            os._exit(0)
    theirs.close()
    os.close(w)
    data = os.read(r, 8)
    os.close(r)
    if len(data) != 8:
        ours.close()
        raise RuntimeError("the cell died while starting")
    (init,) = struct.unpack("<q", data)
    return {"cell_pid": cell_pid, "pid": init}, ours


def serve(sock: socket.socket, workers: int, processes: int) -> None:
    for name in PRELOAD:
        try:
            __import__(name)
        except ImportError:
            pass
    _warm_up()
    _reseed_numpy()  # the first seeding is slow (lazy set-up); pay it once, here
    # Park every object loaded so far outside the collector: a collection in a call would
    # otherwise walk (and so copy-on-write fault) every page of sympy's objects.
    gc.collect()
    gc.freeze()
    caps = {
        "netns": _probe(CLONE_NEWNET),
        "pidns": _probe(CLONE_NEWPID),
        "mountns": _probe(CLONE_NEWPID | CLONE_NEWNS),
        "root": os.geteuid() == 0,
    }
    caps["mountns"] = caps["mountns"] and caps["pidns"]
    if caps["root"]:
        # Every cell's cap, twice over for cells still being torn down, and some slack.
        caps["pids_cgroup"] = _make_pids_cgroup(
            f"rstar2-sandbox-{os.getpid()}", 16 + 2 * workers * (3 + processes)
        )
    # The server compiles programs for the cells (marshal) only if its bytecode is ours.
    magic = importlib.util.MAGIC_NUMBER.hex()
    sock.send(json.dumps({"ready": True, "pid": os.getpid(), "magic": magic, **caps}).encode())

    cgroup = caps.get("pids_cgroup")
    stale: set[str] = set()  # cell cgroups whose processes are still being torn down

    def reap() -> None:
        while True:
            try:
                pid, _ = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                break
            if pid == 0:
                break
            if cgroup:
                stale.add(os.path.join(cgroup, f"cell-{pid}"))
        for path in list(stale):
            try:
                os.rmdir(path)
            except FileNotFoundError:
                pass
            except OSError:
                continue
            stale.discard(path)

    while True:
        ready, _, _ = select.select([sock], [], [], 1.0)
        reap()
        if not ready:
            continue
        try:
            message = sock.recv(1 << 16)
        except InterruptedError:
            continue
        if not message:
            return  # the server closed its end
        try:
            info, cell_sock = _start_cell(json.loads(message), caps, processes)
        except Exception as exc:
            traceback.print_exc()
            sock.send(json.dumps({"error": f"{type(exc).__name__}: {exc}"}).encode())
            continue
        try:
            socket.send_fds(sock, [json.dumps(info).encode()], [cell_sock.fileno()])
        finally:
            cell_sock.close()


def main() -> None:
    fd, workers, processes = (int(a) for a in sys.argv[1:4])
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a Ctrl-C for the server is not for us
    sock = socket.socket(fileno=fd)
    try:
        serve(sock, workers, processes)
    finally:
        sock.close()


if __name__ == "__main__":
    main()
