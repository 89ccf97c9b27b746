"""Hostile programs against a real sandbox service: each must get the right structured status, and
the service must keep answering afterwards, with no process or temp dir of the call left behind.

One service for the module (2 workers, short limits). About 40 s on two cores.

    .venv/bin/python -m pytest tests/test_sandbox_hostile.py -v
"""

import asyncio
import json
import os
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import aiohttp
import pytest

from tasks.records import ToolResult, ToolStatus
from tasks.sandbox.client import SandboxClient
from tasks.sandbox.executor import TRUNCATION_MARKER, Limits
from tasks.sandbox.server import SandboxService
from tests.sandbox_helpers import execute, service_with_secret

LIMITS = Limits(timeout_s=1.5, cpu_s=1, memory_mb=256, output_bytes=2048, processes=16)
SECRET_NAME = "RSTAR2_HOSTILE_TEST_SECRET"
SECRET_VALUE = "correct-horse-battery-staple"
PROJECT_ROOT = Path(__file__).resolve().parents[1]
MARK = f"rstar2hostile{uuid.uuid4().hex[:8]}"  # tags processes and files these programs leave

S = ToolStatus


@pytest.fixture(scope="module")
def service() -> Iterator[SandboxService]:
    with service_with_secret(LIMITS, SECRET_NAME, SECRET_VALUE) as sandbox:
        yield sandbox


def get_json(url: str) -> dict:
    async def go() -> dict:
        async with aiohttp.ClientSession() as session, session.get(url) as response:
            return await response.json()

    return asyncio.run(go())


def processes_with(marker: str) -> list[int]:
    """Host pids whose command line mentions `marker`."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == os.getpid():
            continue
        try:
            cmdline = Path(f"/proc/{entry}/cmdline").read_bytes()
        except OSError:
            continue
        if marker.encode() in cmdline:
            found.append(int(entry))
    return found


def assert_healthy(url: str) -> None:
    result = execute(url, "print(6 * 7)")
    assert (result.status, result.stdout) == (S.OK, "42\n"), result


# (id, code, stdin, allowed statuses, extra check on the result or None)
HOSTILE: list[tuple[str, str, str, set[ToolStatus], object]] = [
    # --- processes
    ("fork_bomb", "import os\nwhile True:\n    os.fork()", "", {S.ERROR, S.TIMEOUT, S.KILLED, S.OUTPUT_LIMIT}, None),
    (
        "fork_bomb_that_swallows_errors",
        "import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass",
        "",
        {S.TIMEOUT},
        None,
    ),
    (
        "thread_storm",
        "import threading, time\nfor _ in range(10000):\n"
        "    threading.Thread(target=time.sleep, args=(100,), daemon=True).start()",
        "",
        {S.ERROR},
        lambda r: "can't start new thread" in r.stderr,
    ),
    (
        "multiprocessing_cpu_burn",
        "import multiprocessing as mp\ndef burn(_):\n    while True:\n        pass\n"
        "with mp.Pool(4) as pool:\n    pool.map(burn, range(4))",
        "",
        {S.TIMEOUT, S.ERROR},
        None,
    ),
    # --- time
    ("infinite_loop", "while True:\n    pass", "", {S.TIMEOUT}, None),
    ("sleep_forever", "import time\ntime.sleep(10**6)", "", {S.TIMEOUT}, None),
    (
        "ignore_sigterm_and_spin",
        "import signal\nfor s in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGXCPU):\n"
        "    signal.signal(s, signal.SIG_IGN)\nwhile True:\n    pass",
        "",
        {S.TIMEOUT},
        None,
    ),
    (
        "block_all_signals_and_sleep",
        "import signal, time\nsignal.pthread_sigmask(signal.SIG_BLOCK, set(signal.Signals))\ntime.sleep(10**6)",
        "",
        {S.TIMEOUT},
        None,
    ),
    # --- memory
    # Address space grows 10 MB at a time (zeroed pages, so the 1 s CPU limit is not what stops it
    # on a loaded machine).
    ("memory_bomb_list", "x = []\nwhile True:\n    x.append(bytearray(10**7))", "", {S.MEMORY}, None),
    ("memory_bomb_numpy", "import numpy as np\nnp.ones(10**10)", "", {S.MEMORY}, None),
    ("memory_bomb_bytes", "b'x' * (10**11)", "", {S.MEMORY}, None),
    # --- output
    (
        "giant_stdout",
        "while True:\n    print('y' * 1000)",
        "",
        {S.OUTPUT_LIMIT},
        lambda r: r.stdout.endswith(TRUNCATION_MARKER),
    ),
    (
        "giant_stderr",
        "import sys\nwhile True:\n    sys.stderr.write('z' * 1000)",
        "",
        {S.OUTPUT_LIMIT},
        lambda r: r.stderr.endswith(TRUNCATION_MARKER),
    ),
    ("giant_single_write", "import os\nos.write(1, b'q' * 10**8)", "", {S.OUTPUT_LIMIT}, None),
    (
        "invalid_utf8_output",
        "import sys\nsys.stdout.buffer.write(b'ok\\xff\\xfe\\n')",
        "",
        {S.OK},
        lambda r: r.stdout.startswith("ok"),
    ),
    ("close_stdout_and_stderr", "import os\nos.close(1)\nos.close(2)\nprint('gone')", "", {S.OK, S.ERROR}, None),
    # --- input
    ("stdin_read_with_no_input", "input()", "", {S.ERROR}, lambda r: "EOFError" in r.stderr),
    (
        "huge_stdin",
        "import sys\nprint(len(sys.stdin.read()))",
        "a" * (20 << 20),
        {S.OK},
        lambda r: r.stdout == f"{20 << 20}\n",
    ),
    # --- crashes and exits
    ("recursion_limit", "def f():\n    return f()\nf()", "", {S.ERROR}, lambda r: "RecursionError" in r.stderr),
    (
        "deep_recursion_segfault",
        # Recursion through C (sorted's key) past the stack: Python 3.11 keeps its own frames
        # on the heap, so plain Python recursion runs into the CPU limit instead.
        "import sys\nsys.setrecursionlimit(10**8)\ndef f(n):\n    return sorted([n], key=f)\nf(0)",
        "",
        {S.KILLED},
        lambda r: r.exit_code == -11,
    ),
    ("ctypes_segfault", "import ctypes\nctypes.string_at(0)", "", {S.KILLED}, lambda r: r.exit_code == -11),
    ("abort", "import os\nos.abort()", "", {S.KILLED}, lambda r: r.exit_code == -6),
    ("sys_exit_3", "import sys\nsys.exit(3)", "", {S.ERROR}, lambda r: r.exit_code == 3),
    ("sys_exit_0", "import sys\nprint('bye')\nsys.exit(0)", "", {S.OK}, lambda r: r.stdout == "bye\n"),
    (
        "sys_exit_message",
        "import sys\nsys.exit('fatal: no')",
        "",
        {S.ERROR},
        lambda r: r.exit_code == 1 and "fatal: no" in r.stderr,
    ),
    ("os_exit_7", "import os\nos._exit(7)", "", {S.ERROR}, lambda r: r.exit_code == 7),
    ("keyboard_interrupt", "raise KeyboardInterrupt", "", {S.ERROR}, None),
    ("null_bytes_in_source", "print(1)\x00", "", {S.ERROR}, None),
    # --- killing things outside the program
    # As uid nobody the cell's init cannot be signalled at all; as root it ignores the signal.
    (
        "kill_parent",
        "import os\nos.kill(os.getppid(), 9)\nprint('survived')",
        "",
        {S.ERROR, S.OK},
        lambda r: "PermissionError" in r.stderr or r.stdout == "survived\n",
    ),
    ("kill_own_group", "import os\nos.killpg(0, 9)", "", {S.KILLED}, None),
    ("kill_everything", "import os\nos.kill(-1, 9)\nprint('alive')", "", {S.OK, S.ERROR}, None),
    ("kill_pid_1_in_namespace", "import os\nos.kill(1, 9)\nprint('init ignores it')", "", {S.OK, S.ERROR}, None),
    # --- network
    ("dns_and_internet", "import socket\nsocket.create_connection(('8.8.8.8', 53), timeout=1)", "", {S.ERROR}, None),
    # --- filesystem
    (
        "write_etc_shadow",
        "open('/etc/shadow', 'a').write('x')",
        "",
        {S.ERROR},
        lambda r: "Read-only file system" in r.stderr or "Permission denied" in r.stderr,
    ),
    (
        "write_tmp",
        f"open('/tmp/{MARK}-file', 'w').write('x')",
        "",
        {S.ERROR},
        lambda r: not Path(f"/tmp/{MARK}-file").exists(),
    ),
    (
        "write_project_dir",
        f"open('{PROJECT_ROOT}/{MARK}-file', 'w').write('x')",
        "",
        {S.ERROR},
        lambda r: not (PROJECT_ROOT / f"{MARK}-file").exists(),
    ),
    (
        "write_dev_shm_stays_private",
        f"open('/dev/shm/{MARK}', 'w').write('x')\nprint('ok')",
        "",
        {S.OK},
        lambda r: not Path(f"/dev/shm/{MARK}").exists(),
    ),
    (
        "multiprocessing_pool_works",
        "import multiprocessing as mp\ndef sq(x):\n    return x * x\n"
        "with mp.Pool(2) as pool:\n    print(pool.map(sq, range(5)))",
        "",
        {S.OK},
        lambda r: r.stdout == "[0, 1, 4, 9, 16]\n",
    ),
    ("write_sysctl", "open('/proc/sys/kernel/hostname', 'w').write('pwned')", "", {S.ERROR}, None),
    (
        "remount_root_rw",
        "import ctypes\nassert ctypes.CDLL(None).mount(None, b'/', None, 32, None) != 0\nprint('no')",
        "",
        {S.OK},
        None,
    ),
    (
        "unshare_user_namespace_escape",
        "import ctypes\nlibc = ctypes.CDLL(None)\n"
        "assert libc.unshare(0x40000000) != 0 and libc.unshare(0x00020000) != 0\nprint('no')",
        "",
        {S.OK},
        None,
    ),
    ("file_size_limit", "open('big', 'wb').write(b'0' * (64 << 20))", "", {S.ERROR, S.MEMORY}, None),
    (
        "open_files_limit",
        "fs = [open('f%d' % i, 'w') for i in range(100000)]",
        "",
        {S.ERROR},
        lambda r: "Too many open files" in r.stderr,
    ),
    (
        "see_other_processes",
        "import os\npids = [p for p in os.listdir('/proc') if p.isdigit()]\nprint(len(pids))",
        "",
        {S.OK},
        lambda r: int(r.stdout) <= 3,
    ),
    (
        "inherited_descriptors",
        "import os\nprint(sorted(int(fd) for fd in os.listdir('/proc/self/fd')))",
        "",
        {S.OK},
        lambda r: json.loads(r.stdout) in ([0, 1, 2], [0, 1, 2, 3]),
    ),  # 3: the listdir itself
    (
        "env_secrets",
        f"import os\nprint({SECRET_NAME!r} in os.environ, {SECRET_VALUE!r} in str(os.environ))",
        "",
        {S.OK},
        lambda r: r.stdout == "False False\n",
    ),
    (
        "other_processes_environ",
        "import os\nfor p in os.listdir('/proc'):\n    if p.isdigit():\n        try:\n"
        "            print(open(f'/proc/{p}/environ').read())\n        except OSError:\n"
        "            pass",
        "",
        {S.OK},
        lambda r: SECRET_VALUE not in r.stdout,
    ),
]


@pytest.mark.parametrize("code, stdin, allowed, check", [h[1:] for h in HOSTILE], ids=[h[0] for h in HOSTILE])
def test_hostile_program(service: SandboxService, code, stdin, allowed, check) -> None:
    started = time.monotonic()
    result = execute(service.url, code, stdin)
    assert result.status in allowed, result
    if check is not None:
        assert check(result), result
    assert time.monotonic() - started < LIMITS.timeout_s + 3
    assert_healthy(service.url)


def test_network_cannot_reach_the_sandbox_itself(service: SandboxService) -> None:
    code = f"import socket\nsocket.create_connection(('127.0.0.1', {service.port}), timeout=1)"
    result = execute(service.url, code)
    assert result.status == S.ERROR, result
    assert "Network is unreachable" in result.stderr or "refused" in result.stderr
    stats = get_json(service.url + "/stats")
    if not stats["template"].get("netns"):
        pytest.skip("this kernel gives no network namespace (logged at start-up)")


def test_template_pid_is_invisible_and_unkillable(service: SandboxService) -> None:
    pid = get_json(service.url + "/stats")["template"]["pid"]
    result = execute(service.url, f"import os\nos.kill({pid}, 9)")
    assert result.status == S.ERROR and "ProcessLookupError" in result.stderr
    assert get_json(service.url + "/stats")["template"]["pid"] == pid


def test_setsid_escape_is_killed_with_the_call(service: SandboxService) -> None:
    code = (
        "import os, subprocess\n"
        f"subprocess.Popen(['sleep', '1000', '{MARK}'], start_new_session=True)\n"
        "if os.fork() == 0:\n"
        "    os.setsid()\n"
        "    if os.fork() == 0:\n"
        f"        os.execvp('sleep', ['sleep', '999', '{MARK}'])\n"
        "    os._exit(0)\n"
        "print('escaped?')"
    )
    result = execute(service.url, code)
    assert result.status == S.OK and result.wall_s < LIMITS.timeout_s
    deadline = time.monotonic() + 3
    while processes_with(MARK) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert processes_with(MARK) == []


def test_timed_out_background_processes_are_gone(service: SandboxService) -> None:
    code = (
        "import os, time\n"
        "for _ in range(3):\n"
        "    if os.fork() == 0:\n"
        "        os.setsid()\n"
        f"        os.execvp('sleep', ['sleep', '1001', '{MARK}'])\n"
        "time.sleep(100)"
    )
    assert execute(service.url, code).status == S.TIMEOUT
    deadline = time.monotonic() + 3
    while processes_with(MARK) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert processes_with(MARK) == []


def test_temp_dirs_are_removed_even_after_a_timeout(service: SandboxService) -> None:
    code = "import os, time\nprint(os.getcwd(), flush=True)\nopen('x', 'w').write('1')\n"
    code += "time.sleep(100)"
    result = execute(service.url, code)
    assert result.status == S.TIMEOUT
    cwd = Path(result.stdout.strip())
    assert cwd.name == "home" and not cwd.exists()


def test_random_numbers_differ_between_calls(service: SandboxService) -> None:
    code = "import random, numpy as np\nprint(random.random(), np.random.rand())"
    outputs = {execute(service.url, code).stdout for _ in range(3)}
    assert len(outputs) == 3


def test_dead_template_is_restarted(service: SandboxService) -> None:
    before = get_json(service.url + "/stats")["template"]
    os.kill(before["pid"], 9)
    stat = Path(f"/proc/{before['pid']}/stat")
    while stat.exists() and stat.read_text().rsplit(")", 1)[1].split()[0] != "Z":
        time.sleep(0.01)  # dead, not yet reaped by the server
    assert_healthy(service.url)
    after = get_json(service.url + "/stats")["template"]
    assert after["alive"] and after["pid"] != before["pid"]
    assert after["restarts"] == before["restarts"] + 1


def test_concurrent_hostile_mix_keeps_every_answer(service: SandboxService) -> None:
    calls = [
        ("while True:\n    pass", ""),
        ("import os\nos.kill(os.getppid(), 9)", ""),
        # Large zero-filled allocations, which bytes() takes untouched from the kernel: a bomb
        # that writes its memory can meet the wall-clock limit first on a loaded machine, and
        # which limit comes first is not what this test is about.
        ("x = [bytes(10**8) for _ in range(100)]", ""),
        ("print('z' * 10**6)", ""),
    ] + [(f"print({i})", "") for i in range(12)]

    async def go() -> list[ToolResult]:
        async with SandboxClient([service.url], timeout_s=60) as client:
            return await asyncio.gather(*(client.execute(c, s) for c, s in calls))

    results = asyncio.run(go())
    assert results[0].status == S.TIMEOUT
    assert results[1].status in (S.ERROR, S.OK)  # see kill_parent
    assert [r.status for r in results[2:4]] == [S.MEMORY, S.OUTPUT_LIMIT]
    assert [r.stdout for r in results[4:]] == [f"{i}\n" for i in range(12)]
    stats = get_json(service.url + "/stats")
    assert stats["in_flight"] == 0


def pids_cgroup_of(pid: int) -> Path | None:
    for line in Path(f"/proc/{pid}/cgroup").read_text().splitlines():
        _, controllers, path = line.split(":", 2)
        if "pids" in controllers.split(","):
            return Path("/sys/fs/cgroup/pids" + path)
    return None


def test_nothing_is_left_in_the_cells_cgroups(service: SandboxService) -> None:
    """Between calls each cell's cgroup holds just the cell (C and its init I): every process a
    call started, fork bombs included, is gone."""
    if not get_json(service.url + "/stats")["template"].get("pids_cgroup"):
        pytest.skip("no pids cgroup on this machine (logged at start-up)")
    bomb = "import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass"
    assert execute(service.url, bomb).status == S.TIMEOUT
    cells = get_json(service.url + "/stats")["template"]["cells"]
    groups = [pids_cgroup_of(pid) for pid in cells]
    assert all(g is not None and g.name.startswith("cell-") for g in groups), groups
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        counts = [len((g / "cgroup.procs").read_text().split()) for g in groups]
        if all(n == 2 for n in counts):
            break
        time.sleep(0.2)
    assert counts == [2] * len(cells)


def test_pool_falls_back_to_fresh_interpreters_when_the_template_cannot_start() -> None:
    from tasks.sandbox.executor import TemplatePool

    lines: list[str] = []
    pool = TemplatePool(LIMITS, workers=1, log=lines.append)

    def broken() -> None:
        raise RuntimeError("sandbox template did not start: test")

    pool._spawn_template = broken  # type: ignore[method-assign]

    async def go() -> ToolResult:
        return await pool.run("x = 20\nx + 22", "")

    result = asyncio.run(go())
    pool.close()
    assert (result.status, result.stdout) == (S.OK, "42\n")
    assert any("falling back" in line for line in lines)
