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
           "statistics", "json", "string", "heapq", "bisect", "random", "cmath",
           "numpy", "sympy")  # fmt: skip

CLONE_NEWNS = 0x00020000
CLONE_NEWPID = 0x20000000
CLONE_NEWNET = 0x40000000
MS_REC = 0x4000
MS_PRIVATE = 1 << 18
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC = 1, 2, 4, 8
MS_REMOUNT, MS_BIND = 32, 4096

EXIT_MEMORY = 86  # kept equal to executor._EXIT_MEMORY
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


def _vm_size() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[0]) * resource.getpagesize()


def _lock_down_mounts(home: str) -> None:
    """In X, inside its own mount namespace: a private /proc, and every mount read-only except
    the call's working directory, so that even a program running as root cannot write outside
    it (it has no capabilities left to remount)."""
    # Private propagation first, so that nothing done here leaks back to the host.
    _mount(None, b"/", None, MS_REC | MS_PRIVATE)
    _mount(b"proc", b"/proc", b"proc", MS_NOSUID | MS_NODEV | MS_NOEXEC)
    _mount(b"/proc/sys", b"/proc/sys", None, MS_BIND | MS_REC)
    _mount(b"/proc/sysrq-trigger", b"/proc/sysrq-trigger", None, MS_BIND)
    home_b = os.fsencode(home)
    _mount(home_b, home_b, None, MS_BIND)
    with open("/proc/self/mountinfo", "rb") as f:
        lines = f.read().splitlines()
    for line in lines:
        parts = line.split()
        target = parts[4].replace(b"\\040", b" ").replace(b"\\011", b"\t")
        if target == home_b or target == b"/proc":
            continue
        options = set(parts[5].split(b","))
        flags = MS_REMOUNT | MS_BIND | MS_RDONLY
        for name, bit in ((b"nosuid", MS_NOSUID), (b"nodev", MS_NODEV), (b"noexec", MS_NOEXEC)):
            if name in options:
                flags |= bit
        _mount(None, target, None, flags)
    if os.path.isdir("/dev/shm"):
        # multiprocessing's locks and queues need a writable /dev/shm: a small private one,
        # gone with the namespace.
        _mount(b"tmpfs", b"/dev/shm", b"tmpfs", MS_NOSUID | MS_NODEV,
               b"size=64m,nr_inodes=4096,mode=1777")  # fmt: skip


def _drop_capabilities() -> None:
    """Root without capabilities: no remounting, no new namespaces, no raw sockets, no ptrace of
    strangers; files are still checked against uid 0's own permission bits (hence the read-only
    mounts). Also for any program it execs (empty bounding set, no_new_privs)."""
    _libc.prctl(38, 1, 0, 0, 0)  # PR_SET_NO_NEW_PRIVS
    for cap in range(64):
        _libc.prctl(24, cap, 0, 0, 0)  # PR_CAPBSET_DROP; EINVAL past the last cap is fine
    header = (ctypes.c_uint32 * 2)(0x20080522, 0)  # _LINUX_CAPABILITY_VERSION_3, this thread
    data = (ctypes.c_uint32 * 6)()  # effective, permitted, inheritable x 2 words: all zero
    _libc.capset(header, data)


def _program(req: dict, fds: list[int], drop_to: int | None, caps: dict) -> None:
    """In X: isolate, run, exit. Never returns."""
    code_rc = 1
    try:
        for sig in (signal.SIGCHLD, signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
            signal.signal(sig, signal.SIG_DFL)
        signal.signal(signal.SIGPIPE, signal.SIG_IGN)  # as in a fresh interpreter
        # Our own process group: `os.kill(0, 9)` or `os.killpg(0, 9)` must not reach the warden.
        # The server's kill of the warden's group still ends us: it takes the namespace's init.
        os.setpgid(0, 0)
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
        if os.geteuid() == 0:
            _drop_capabilities()
        lim = req["limits"]
        base = _vm_size()
        nproc = ((resource.RLIMIT_NPROC, lim["processes"], lim["processes"]),)
        for which, soft, hard in (
            (resource.RLIMIT_CPU, lim["cpu_s"], lim["cpu_s"] + 1),
            # On top of the pre-loaded template: numpy and sympy are already mapped.
            (resource.RLIMIT_AS, base + (lim["memory_mb"] << 20), base + (lim["memory_mb"] << 20)),
            (resource.RLIMIT_FSIZE, lim["file_size_mb"] << 20, lim["file_size_mb"] << 20),
            (resource.RLIMIT_NOFILE, lim["open_files"], lim["open_files"]),
        # RLIMIT_NPROC counts every process of the uid, so concurrent calls run as nobody would
        # share it; the per-call pids cgroup, where there is one, is the better cap.
        ) + (nproc if os.geteuid() and not caps.get("pids_cgroup") else ()):
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
        cgroup = caps.get("pids_cgroup")
        mine = None
        if cgroup:
            # A cap per call, so that one call's fork bomb cannot starve the others.
            mine = os.path.join(cgroup, f"call-{os.getpid()}")
            try:
                os.mkdir(mine)
                _write(os.path.join(mine, "pids.max"), str(req["limits"]["processes"] + 3))
                _write(os.path.join(mine, "cgroup.procs"), str(os.getpid()))
            except OSError:
                mine = None
        for fd in fds:
            os.set_inheritable(fd, False)  # the init must hold none of the call's pipes
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
                _lock_down_mounts(req["home"])
            _program(req, fds, drop_to, caps)
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
            os.waitpid(init, 0)  # returns once the kernel has emptied the namespace
        if mine is not None:
            _write(os.path.join(cgroup, "cgroup.procs"), str(os.getpid()))
            os.rmdir(mine)
    finally:
        os._exit(0)


def _write(path: str, text: str) -> None:
    with open(path, "w") as f:
        f.write(text)


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
        # Per call: W, init, X and `processes` more; twice over for calls still being torn down.
        caps["pids_cgroup"] = _join_pids_cgroup(16 + 2 * workers * (3 + processes))
    sock.send(json.dumps({"ready": True, "pid": os.getpid(), **caps}).encode())

    cgroup = caps.get("pids_cgroup")
    stale: set[str] = set()  # per-call cgroups whose warden died before removing them

    def reap() -> None:
        while True:
            try:
                pid, _ = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                break
            if pid == 0:
                break
            if cgroup:
                stale.add(os.path.join(cgroup, f"call-{pid}"))
        for path in list(stale):
            try:
                os.rmdir(path)
            except FileNotFoundError:
                pass
            except OSError:
                continue  # still has processes being killed; next round
            stale.discard(path)

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
        except Exception as exc:
            # Tell the server at once (e.g. the fork hit the process cap) instead of letting it
            # mistake this for a dead template.
            try:
                os.write(fds[2], b"E" + f"{type(exc).__name__}: {exc}".encode()[:200])
            except (OSError, IndexError):
                pass
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
