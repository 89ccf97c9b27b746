"""The kernel isolation of a cell: namespaces, the pids cgroup, the filesystem view, privileges.

Run in the template (T) and its forks (see template.py for the processes): T probes once what
the kernel allows (`probe`), a new cell (C) joins its cgroup and unshares its namespaces
(`enter_cell_namespaces`), the cell's init (I) sets up its filesystem view (`set_up_filesystem`),
and each program (X) drops its privileges (`drop_privileges`). The server uses the rest: it
removes a template's cgroup and logs what isolation it got, in words. Standard library only.
"""

import ctypes
import json
import os
import stat
import sys
import time

CLONE_NEWNS = 0x00020000
CLONE_NEWPID = 0x20000000
CLONE_NEWNET = 0x40000000
MS_REC = 0x4000
MS_PRIVATE = 1 << 18
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC = 1, 2, 4, 8
MS_REMOUNT, MS_BIND = 32, 4096
PR_SET_CHILD_SUBREAPER = 36
PR_SET_NO_NEW_PRIVS = 38
NOBODY = 65534

libc = ctypes.CDLL(None, use_errno=True)


def _unshare(flags: int) -> bool:
    return libc.unshare(ctypes.c_int(flags)) == 0


def _mount(source: bytes | None, target: bytes, fstype: bytes | None, flags: int, data: bytes | None = None) -> bool:
    return libc.mount(source, target, fstype, ctypes.c_ulong(flags), data) == 0


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


def probe(workers: int, processes: int) -> dict:
    """What isolation the kernel allows here (done once, in T), with the pool's pids cgroup."""
    caps = {
        "netns": _probe(CLONE_NEWNET),
        "pidns": _probe(CLONE_NEWPID),
        "mountns": _probe(CLONE_NEWPID | CLONE_NEWNS),
        "root": os.geteuid() == 0,
    }
    caps["mountns"] = caps["mountns"] and caps["pidns"]
    if caps["root"]:
        # Every cell's cap, twice over for cells still being torn down, and some slack.
        caps["pids_cgroup"] = _make_pids_cgroup(f"rstar2-sandbox-{os.getpid()}", 16 + 2 * workers * (3 + processes))
    return caps


def cell_cgroup(pool_cgroup: str, cell_pid: int) -> str:
    return os.path.join(pool_cgroup, f"cell-{cell_pid}")


def enter_cell_namespaces(caps: dict, processes: int) -> None:
    """In C: join a pids cgroup of its own, then unshare what `probe` found allowed."""
    if caps.get("pids_cgroup"):
        # C, I, X and what X starts: one cap per cell, so that one call's fork bomb cannot
        # starve the other cells.
        mine = cell_cgroup(caps["pids_cgroup"], os.getpid())
        os.mkdir(mine)
        _write(os.path.join(mine, "pids.max"), str(processes + 3))
        _write(os.path.join(mine, "cgroup.procs"), str(os.getpid()))
    flags = CLONE_NEWNET if caps["netns"] else 0
    flags |= CLONE_NEWPID if caps["pidns"] else 0
    flags |= CLONE_NEWNS if caps["mountns"] else 0
    if flags:
        _unshare(flags)


def remove_pool_cgroup(path: str) -> None:
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


def set_up_filesystem(cell_dir: str, pool_dir: str, package_root: str, nobody: bool) -> None:
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
        _mount(b"tmpfs", b"/dev/shm", b"tmpfs", MS_NOSUID | MS_NODEV, b"size=64m,nr_inodes=4096,mode=1777")


def nobody_can_import(package_root: str) -> tuple[bool, str]:
    """Whether uid nobody can read the import directories (imports after the drop)."""
    dirs = _readable_imports(package_root)
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(r)
        try:
            drop_privileges(NOBODY)
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
# Privileges of a program (run in X, after its fork)


def drop_privileges(uid: int | None) -> None:
    """Become `uid` (None: stay), and drop every capability if that leaves us root."""
    if uid is not None:
        os.setgroups([])
        os.setgid(uid)
        os.setuid(uid)
    if os.geteuid() == 0:
        _drop_capabilities()


def _drop_capabilities() -> None:
    """Root without capabilities: no remounting, no new namespaces, no raw sockets, no ptrace of
    strangers; files are still checked against uid 0's own permission bits (hence the read-only
    mounts). Also for any program it execs (empty bounding set; no_new_privs comes from I)."""
    for cap in range(64):
        libc.prctl(24, cap, 0, 0, 0)  # PR_CAPBSET_DROP; EINVAL past the last cap is fine
    header = (ctypes.c_uint32 * 2)(0x20080522, 0)  # _LINUX_CAPABILITY_VERSION_3, this thread
    data = (ctypes.c_uint32 * 6)()  # effective, permitted, inheritable x 2 words: all zero
    libc.capset(header, data)


# ------------------------------------------------------------------------------------------------
# In words, for the server's log


def describe_isolation(r: dict) -> list[str]:
    """The template's report (`probe`'s result and its pid), one line per layer."""
    lines = [
        f"sandbox template pid {r.get('pid')} ready (numpy, sympy pre-loaded)",
        "sandbox isolation: network "
        + (
            "none for programs (own empty network namespace per cell)"
            if r.get("netns")
            else "NOT ISOLATED: the kernel refused unshare(CLONE_NEWNET); programs can reach the network"
        ),
        "sandbox isolation: pid namespace "
        + (
            "on (escaped background processes die with the call)"
            if r.get("pidns")
            else "NOT available: escapes are hunted as children of the cell (subreaper)"
        )
        + (
            "; private /proc, read-only mounts"
            if r.get("mountns")
            else "; host /proc visible, host mounts writable where the uid may write"
        ),
    ]
    if r.get("root"):
        lines.append(
            f"sandbox isolation: pids cgroup {r.get('pids_cgroup')}"
            if r.get("pids_cgroup")
            else "sandbox isolation: no pids cgroup: a fork bomb run as root is bounded only by the wall-clock kill"
        )
    return lines


def describe_privileges(r: dict) -> list[str]:
    """A cell's readiness report (`nobody_can_import`'s verdict) when running as root."""
    if not r.get("root"):
        return []
    if r.get("drop_privileges"):
        return ["sandbox isolation: running as root; programs run as nobody (65534)"]
    return [
        "sandbox isolation: running as root and NOT dropping privileges: uid nobody "
        f"cannot read the interpreter's files ({r.get('drop_privileges_blocked_by')}); "
        "programs run as uid 0 without capabilities, on read-only mounts"
    ]
