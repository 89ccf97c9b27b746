"""The template process (T): numpy and sympy imported once, cells forked from it, one per worker.

The server starts this module as a child process and talks to it over a SOCK_SEQPACKET Unix
socket (tasks/sandbox/protocol.py). T imports and warms up the heavy modules, then serves one
kind of request: "start a cell". A cell is a long-lived copy of T in its own namespaces:

    T --fork--> C: joins the cell's pids cgroup, unshares net, pid and mount namespaces where
                   allowed (isolation.py); forks I, reports I's pid to T, then only waits for I.
    C --fork--> I: pid 1 of the new pid namespace; sets up the cell's filesystem view once, then
                   runs the server's calls one after another (cell.py).
    I --fork--> X: one call's program, isolated and limited, run by the runner (runner.py).

T answers a cell request with I's pid and the server's end of a socket pair to I; the server
then sends each call straight to an idle cell.

So each call costs one fork of the loaded interpreter and no namespace set-up: creating and
tearing down net, pid and mount namespaces per call cost ~4 ms of CPU, and a second fork of the
loaded template per call ~3 ms more (measured on a 2-core VM, where every page fault is dear).
Namespaces are shared by the calls of one cell one after another, never at once, and nothing of
a call survives it: its processes are killed, its directory and /dev/shm emptied.

The first message T sends is a JSON report of what isolation the kernel allowed; the server logs
it, and each cell's readiness report the same way.
"""

import gc
import importlib.util
import os
import select
import signal
import socket
import struct
import sys
import traceback

from tasks.sandbox import protocol
from tasks.sandbox.cell import reseed_numpy, run_init
from tasks.sandbox.isolation import cell_cgroup, enter_cell_namespaces, probe

# Loaded once here, shared copy-on-write by every call.
PRELOAD = (
    "math",
    "itertools",
    "fractions",
    "functools",
    "collections",
    "decimal",
    "re",
    "statistics",
    "json",
    "string",
    "heapq",
    "bisect",
    "random",
    "cmath",
    "numpy",
    "sympy",
)


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
            enter_cell_namespaces(caps, processes)
            init = os.fork()
            if init == 0:
                os.close(w)
                run_init(theirs, {**spec, "cgroup": caps.get("pids_cgroup")}, caps)
            theirs.close()
            os.write(w, struct.pack("<q", init))
            os.close(w)
            os.waitpid(init, 0)
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
    reseed_numpy()  # the first seeding is slow (lazy set-up); pay it once, here
    # Park every object loaded so far outside the collector: a collection in a call would
    # otherwise walk (and so copy-on-write fault) every page of sympy's objects.
    gc.collect()
    gc.freeze()
    caps = probe(workers, processes)
    # The server compiles programs for the cells (marshal) only if its bytecode is ours.
    magic = importlib.util.MAGIC_NUMBER.hex()
    protocol.send_json(sock, {"ready": True, "pid": os.getpid(), "magic": magic, **caps})

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
                stale.add(cell_cgroup(cgroup, pid))
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
        spec = protocol.receive_cell_request(sock)
        if spec is None:
            return  # the server closed its end
        try:
            info, cell_sock = _start_cell(spec, caps, processes)
        except Exception as exc:
            traceback.print_exc()
            protocol.send_json(sock, {"error": f"{type(exc).__name__}: {exc}"})
            continue
        try:
            protocol.answer_cell(sock, info, cell_sock)
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
