"""The template (zygote) process: imports the heavy modules once, then forks one program per call.

The server starts this module as a child process and talks to it over a SOCK_SEQPACKET Unix
socket. Each request is one message: a JSON header (working dir, code and stdin paths, limits)
plus three descriptors passed with SCM_RIGHTS: the write ends of the call's stdout, stderr and
status pipes. The template never answers a request; everything the server needs travels on the
status pipe, which the server reads alongside the output:

    template T --fork--> warden W: setsid(); unshare(net, pid, mount namespaces where allowed);
                         writes b"P" + its pid (the process group the server kills on timeout);
                         spawns `sleep` as the pid namespace's init (pid 1, exec'd: cheap);
    W --fork--> program X: pid 2 of the namespace; mounts its own /proc; fd 0/1/2 from the call,
                         every other descriptor closed, private cwd, scrubbed environment,
                         rlimits, fresh random seeds; runs the code with the final bare
                         expression echoed, as a fresh interpreter would.
    W waits for X, writes b"S" + X's wait status, and kills the init: the kernel then kills every
    process left in the namespace, including ones that escaped the group with setsid(). The
    server's group kill on a timeout reaches W and the init (same group), with the same effect.

X is never pid 1: the kernel shields a namespace's init from its own signals, which would turn
`os.kill(os.getpid(), SIGSEGV)` into a no-op. X cannot see W, T or the server (other pid
namespace): its getppid() is 0, and the init it can see ignores its signals.

The first message the template sends is a JSON report of what isolation the kernel allowed;
the server logs it.
"""

import ctypes
import gc
import json
import os
import random
import resource
import select
import shutil
import signal
import socket
import struct
import sys
import traceback
import types

# Loaded once here, shared copy-on-write by every call.
PRELOAD = ("math", "itertools", "fractions", "functools", "collections", "decimal", "re",
           "statistics", "json", "string", "heapq", "bisect", "random", "cmath", "numpy", "sympy")  # fmt: skip

CLONE_NEWNS = 0x00020000
CLONE_NEWPID = 0x20000000
CLONE_NEWNET = 0x40000000
MS_REC = 0x4000
MS_PRIVATE = 1 << 18
MS_NOSUID, MS_NODEV, MS_NOEXEC = 2, 4, 8

EXIT_MEMORY = 86  # kept equal to executor._EXIT_MEMORY
NOBODY = 65534

_libc = ctypes.CDLL(None, use_errno=True)


def _unshare(flags: int) -> bool:
    return _libc.unshare(ctypes.c_int(flags)) == 0


def _mount(source: bytes | None, target: bytes, fstype: bytes | None, flags: int) -> bool:
    return _libc.mount(source, target, fstype, ctypes.c_ulong(flags), None) == 0


def _probe(flags: int) -> bool:
    """Whether a child can unshare these namespaces (checked once, in a throwaway child)."""
    pid = os.fork()
    if pid == 0:
        os._exit(0 if _unshare(flags) else 1)
    _, status = os.waitpid(pid, 0)
    return os.waitstatus_to_exitcode(status) == 0


def _nobody_can_import() -> tuple[bool, str]:
    """Whether uid `nobody` can read this interpreter's library dirs (imports after the drop)."""
    dirs = sorted({p for p in sys.path if p and os.path.isdir(p)})
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


def _join_pids_cgroup(limit: int) -> str | None:
    """Move the template (and so every call) into its own pids cgroup capped at `limit` tasks:
    a fork bomb run as root, which RLIMIT_NPROC does not stop, hits this cap instead."""
    for base in ("/sys/fs/cgroup/pids", "/sys/fs/cgroup/unified", "/sys/fs/cgroup"):
        if not os.path.exists(os.path.join(base, "cgroup.procs")):
            continue
        path = os.path.join(base, f"rstar2-sandbox-{os.getpid()}")
        try:
            os.mkdir(path)
            with open(os.path.join(path, "pids.max"), "w") as f:
                f.write(str(limit))
            with open(os.path.join(path, "cgroup.procs"), "w") as f:
                f.write(str(os.getpid()))
            return path
        except OSError:
            try:
                os.rmdir(path)
            except OSError:
                pass
    return None


# ------------------------------------------------------------------------------------------------
# The program's side


def _report(exc: BaseException) -> None:
    tb = exc.__traceback__.tb_next if exc.__traceback__ is not None else None
    traceback.print_exception(type(exc), exc, tb)


def _execute(source: str) -> int:
    """Run `source` as __main__, echo a final bare expression, return the exit code."""
    import ast
    import linecache

    filename = "<code>"
    linecache.cache[filename] = (len(source), None, source.splitlines(True), filename)
    try:
        tree = ast.parse(source, filename)
        last = None
        if tree.body and isinstance(tree.body[-1], ast.Expr):
            last = compile(ast.Expression(tree.body.pop().value), filename, "eval")
        body = compile(tree, filename, "exec")
    except (SyntaxError, ValueError) as exc:
        sys.stderr.write("".join(traceback.format_exception_only(type(exc), exc)))
        return 1
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
            _report(exc)
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
        _report(exc)
        return 1
    return 0


def _reseed_numpy() -> None:
    # Every call is a fork of the same template: without this, they all draw the same numbers.
    np = sys.modules.get("numpy")
    if np is not None:
        np.random.seed(np.frombuffer(os.urandom(32), dtype=np.uint32))


def _vm_size() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[0]) * resource.getpagesize()


def _program(req: dict, fds: list[int], drop_to: int | None) -> None:
    """In X: isolate, run, exit. Never returns."""
    code_rc = 1
    try:
        for sig in (signal.SIGCHLD, signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
            signal.signal(sig, signal.SIG_DFL)
        signal.signal(signal.SIGPIPE, signal.SIG_IGN)  # as in a fresh interpreter
        out_w, err_w = fds[0], fds[1]
        stdin_fd = os.open(req["stdin_path"], os.O_RDONLY)
        os.dup2(stdin_fd, 0)
        os.dup2(out_w, 1)
        os.dup2(err_w, 2)
        os.closerange(3, 1 << 20)  # the status pipe, the template socket, everything inherited
        home = req["home"]
        with open(req["code_path"], encoding="utf-8", errors="replace") as f:
            source = f.read()
        os.chdir(home)
        os.environ.clear()
        os.environ.update(req["env"])
        if drop_to is not None:
            os.setgroups([])
            os.setgid(drop_to)
            os.setuid(drop_to)
        lim = req["limits"]
        base = _vm_size()
        for which, soft, hard in (
            (resource.RLIMIT_CPU, lim["cpu_s"], lim["cpu_s"] + 1),
            # On top of the pre-loaded template: numpy and sympy are already mapped.
            (resource.RLIMIT_AS, base + (lim["memory_mb"] << 20), base + (lim["memory_mb"] << 20)),
            (resource.RLIMIT_FSIZE, lim["file_size_mb"] << 20, lim["file_size_mb"] << 20),
            (resource.RLIMIT_NOFILE, lim["open_files"], lim["open_files"]),
        ) + (((resource.RLIMIT_NPROC, lim["processes"], lim["processes"]),) if os.geteuid() else ()):
            _, held = resource.getrlimit(which)
            if held != resource.RLIM_INFINITY:
                soft, hard = min(soft, held), min(hard, held)
            resource.setrlimit(which, (soft, hard))
        # Fresh standard streams, as a new interpreter would have (nothing buffered from T).
        sys.stdin = open(0, "r", encoding="utf-8", errors="strict", closefd=False)
        sys.stdout = open(1, "w", encoding="utf-8", closefd=False)
        sys.stderr = open(2, "w", encoding="utf-8", errors="backslashreplace", closefd=False,
                          buffering=1)  # fmt: skip
        sys.argv = [""]
        sys.path = [p for p in sys.path if p not in ("", os.getcwd(), req["package_root"])]
        random.seed()
        _reseed_numpy()
        code_rc = _execute(source)
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


def _warden(req: dict, fds: list[int], caps: dict, drop_to: int | None) -> None:
    """In W: new session and namespaces, report the pgid, start the namespace's init, fork the
    program, report its wait status, end the namespace. Never returns."""
    status_w = fds[2]
    try:
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        os.setsid()
        flags = (CLONE_NEWNET if caps["netns"] else 0) | (CLONE_NEWPID if caps["pidns"] else 0)
        if caps["mountns"]:
            flags |= CLONE_NEWNS
        if flags:
            _unshare(flags)
        os.write(status_w, b"P" + struct.pack("<q", os.getpid()))
        init = None
        if caps["pidns"]:
            # The first process in a pid namespace is its init: a tiny exec'd `sleep` (cheap to
            # start, unlike a fork of this big process). It outlives the program; killing it
            # makes the kernel kill everything left in the namespace.
            init = os.posix_spawn(caps["init"], [caps["init"], "100000"], {}, setsigdef=(
                signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGCHLD))  # fmt: skip
        pid = os.fork()
        if pid == 0:
            if caps["mountns"]:
                # Our own /proc: the program sees only its namespace's processes. Private
                # propagation first, so the mount never leaks back to the host.
                _mount(None, b"/", None, MS_REC | MS_PRIVATE)
                _mount(b"proc", b"/proc", b"proc", MS_NOSUID | MS_NODEV | MS_NOEXEC)
            _program(req, fds, drop_to)
        for fd in fds[:2]:
            os.close(fd)
        while True:
            try:
                _, status = os.waitpid(pid, 0)
                break
            except InterruptedError:
                continue
        os.write(status_w, b"S" + struct.pack("<i", status))
        if init is not None:
            os.kill(init, signal.SIGKILL)
            os.waitpid(init, 0)
    finally:
        os._exit(0)


def serve(sock: socket.socket, workers: int, processes: int) -> None:
    for name in PRELOAD:
        try:
            __import__(name)
        except ImportError:
            pass
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
    caps["init"] = shutil.which("sleep")
    caps["pidns"] = caps["pidns"] and caps["init"] is not None
    caps["mountns"] = caps["mountns"] and caps["pidns"]
    drop_to = None
    if caps["root"]:
        ok, bad = _nobody_can_import()
        caps["drop_privileges"] = ok
        caps["drop_privileges_blocked_by"] = bad
        drop_to = NOBODY if ok else None
        # Each call holds W, U and X plus what the program starts; root ignores RLIMIT_NPROC.
        caps["pids_cgroup"] = _join_pids_cgroup(1 + workers * (3 + processes))
    sock.send(json.dumps({"ready": True, "pid": os.getpid(), **caps}).encode())

    def reap() -> None:
        while True:
            try:
                pid, _ = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:
                return

    while True:
        ready, _, _ = select.select([sock], [], [], 1.0)
        reap()
        if not ready:
            continue
        try:
            msg, fds, _, _ = socket.recv_fds(sock, 1 << 16, 8)
        except InterruptedError:
            continue
        if not msg:
            return  # the server closed its end
        try:
            req = json.loads(msg)
            if len(fds) != 3:
                raise ValueError(f"expected 3 descriptors, got {len(fds)}")
            pid = os.fork()
            if pid == 0:
                sock.close()
                _warden(req, fds, caps, drop_to)
        except Exception:
            traceback.print_exc()
        finally:
            for fd in fds:
                os.close(fd)


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
