"""Tests for the code-execution sandbox: status/result types, the isolated executor's statuses and
limits, the HTTP service (validation, batching, 503 backpressure, stats, the run's credential,
the body limit) and the client (failover, outage -> INTERNAL, a refused credential stops it).

Everything runs against real servers started with SandboxService on 127.0.0.1 and real Python
subprocesses; nothing is mocked. About 10 s on two cores.

    .venv/bin/python -m pytest tests/test_sandbox.py -v
"""

import asyncio
import json
import re
import time
from collections.abc import Iterator
from pathlib import Path

import aiohttp
import pytest

from tasks.records import ToolResult, ToolStatus
from tasks.sandbox.app import MAX_BODY_BYTES, TOKEN_ENV
from tasks.sandbox.client import SandboxClient, SandboxOutage, SandboxRefused
from tasks.sandbox.executor import TRUNCATION_MARKER, Limits
from tasks.sandbox.server import SandboxService, _free_port, main
from tests.sandbox_helpers import execute, service_with_secret

# Short limits keep the timeout tests quick.
LIMITS = Limits(timeout_s=2.0, cpu_s=2, memory_mb=256, output_bytes=1024)
SECRET_NAME = "RSTAR2_SANDBOX_TEST_SECRET"
PROJECT_ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def service() -> Iterator[SandboxService]:
    with service_with_secret(LIMITS, SECRET_NAME, "hunter2") as sandbox:
        yield sandbox


def execute_batch(urls: list[str], calls: list[tuple[str, str]], **client_kw) -> list[ToolResult]:
    async def go() -> list[ToolResult]:
        async with SandboxClient(urls, **client_kw) as client:
            return await client.execute_batch(calls)

    return asyncio.run(go())


# ------------------------------------------------------------------------------------------------
# Types


def test_failure_blames_the_model_not_the_service() -> None:
    failures = {s for s in ToolStatus if s.is_failure}
    assert failures == {"error", "timeout", "memory", "output_limit", "parse_error", "killed"}


def test_result_round_trips_through_json() -> None:
    result = ToolResult(ToolStatus.TIMEOUT, stdout="a", stderr="b", exit_code=-9, wall_s=2.0)
    assert ToolResult.from_dict(json.loads(json.dumps(result.to_dict()))) == result
    assert result.to_dict()["status"] == "timeout"


# ------------------------------------------------------------------------------------------------
# Executor behaviour, through the service


def test_print(service: SandboxService) -> None:
    result = execute(service.url, "print(1 + 1)")
    assert (result.status, result.stdout, result.exit_code) == (ToolStatus.OK, "2\n", 0)


@pytest.mark.parametrize(
    "code, stdout",
    [
        ("x = 21\nx * 2", "42\n"),
        ("print('a')\nNone", "a\n"),  # None is not echoed
        ("x = 1", ""),  # an assignment is not an expression
        ("def f():\n    return 'v'\nf()", "'v'\n"),  # repr, as IPython shows it
    ],
)
def test_final_bare_expression_is_echoed(service: SandboxService, code: str, stdout: str) -> None:
    result = execute(service.url, code)
    assert (result.status, result.stdout) == (ToolStatus.OK, stdout)


@pytest.mark.parametrize(
    "code, stdout, in_stderr",
    [
        # The server compiles most programs for the cells, but not these two (a compile-time
        # warning; past its size cap), which the cell compiles; no program can tell which.
        ("x = 1\nprint(x is 1)", "True\n", 'SyntaxWarning: "is" with a literal'),
        ("x = 0\n" + "x += 1\n" * 3000 + "x", "3000\n", ""),
        ("import sys\nprint(sys.argv, __name__, sys.stdout.seekable())", "[''] __main__ False\n", ""),
    ],
)
def test_program_sees_a_fresh_interpreter(service: SandboxService, code: str, stdout: str, in_stderr: str) -> None:
    result = execute(service.url, code)
    assert (result.status, result.stdout) == (ToolStatus.OK, stdout), result
    assert in_stderr in result.stderr


def test_stdin_is_read(service: SandboxService) -> None:
    code = "import sys\nprint(sum(int(t) for t in sys.stdin.read().split()))"
    assert execute(service.url, code, "1 2\n3\n").stdout == "6\n"


def test_syntax_error(service: SandboxService) -> None:
    result = execute(service.url, "print(")
    assert result.status == ToolStatus.ERROR
    assert "SyntaxError" in result.stderr


def test_exception_gives_traceback_of_the_users_code_only(service: SandboxService) -> None:
    result = execute(service.url, "def f():\n    raise ValueError('boom')\nf()")
    assert result.status == ToolStatus.ERROR and result.exit_code == 1
    assert result.stderr.startswith("Traceback")
    assert "raise ValueError('boom')" in result.stderr  # the source line is quoted
    assert result.stderr.rstrip().endswith("ValueError: boom")
    assert "<string>" not in result.stderr  # no frame from the runner


# What RoC counts as a failed call comes from how the program ended, never from its text: valid
# code that talks on stderr, warns or recovers from its own exception is not a failure; a program
# that dies of its own bug (deep recursion, float into range, a wrong library signature) is.
@pytest.mark.parametrize(
    ("code", "status"),
    [
        ("print('error: Traceback (most recent call last)')", ToolStatus.OK),
        ("import sys\nprint('progress: 50%', file=sys.stderr)\nprint(7)", ToolStatus.OK),
        ("import warnings\nwarnings.warn('deprecated')\nprint(7)", ToolStatus.OK),
        ("try:\n    1 / 0\nexcept ZeroDivisionError:\n    print('fixed')", ToolStatus.OK),
        ("import sys\nprint(7)\nsys.exit(0)", ToolStatus.OK),
        ("def f(n):\n    return n if n == 0 else 1 + f(n - 1)\nprint(f(10**6))", ToolStatus.ERROR),
        ("print(sum(range(10 / 2)))", ToolStatus.ERROR),
        ("import math\nprint(math.comb(10))", ToolStatus.ERROR),
        ("import sys\nsys.exit(3)", ToolStatus.ERROR),
    ],
    ids=["error-in-stdout", "stderr", "warning", "caught", "exit-0", "recursion", "float-range", "signature", "exit-3"],
)
def test_a_failed_call_is_how_the_program_ended_not_what_it_printed(
    service: SandboxService, code: str, status: ToolStatus
) -> None:
    result = execute(service.url, code)
    assert result.status == status, result
    assert result.status.is_failure == (status is not ToolStatus.OK)


def test_the_guarded_kinds_first_program_fails_in_the_sandbox_as_the_sft_recovery_shows(
    service: SandboxService,
) -> None:
    """The unguarded program of a digit problem past the limit fails in the sandbox with the very
    traceback the SFT recovery examples answer it with; the guarded one prints the answer; below
    the limit (level 1 of the digit sums) the unguarded one works too, while a last or first
    digit's power passes the limit at every level. The same for a recursion past 1,000 frames."""
    import random

    from tasks.data.chat_examples import broken_program
    from tasks.data.problems import KINDS, solve, unguarded

    for kind in ("digit_sum", "digit_sum_of_product"):
        big_q, big = KINDS[kind](random.Random(1), 3)
        small_q, small = KINDS[kind](random.Random(1), 1)
        failed, guarded, plain_small = execute_batch(
            [service.url], [(unguarded(big), ""), (big, ""), (unguarded(small), "")]
        )
        assert failed.status is ToolStatus.ERROR, failed
        assert failed.stderr.rstrip().endswith("use sys.set_int_max_str_digits() to increase the limit")
        assert broken_program(big, random.Random(0)) == (unguarded(big), failed.stderr)
        assert guarded.status is ToolStatus.OK and guarded.stdout.strip() == solve(kind, big_q, big)
        assert plain_small.status is ToolStatus.OK and plain_small.stdout.strip() == solve(kind, small_q, small)
    for kind in ("last_digit", "last_digit_of_product", "first_digit"):
        (q, code), (_, least) = KINDS[kind](random.Random(1), 3), KINDS[kind](random.Random(1), 1)
        calls = [(unguarded(code), ""), (unguarded(least), ""), (code, "")]
        failed, failed_least, guarded = execute_batch([service.url], calls)
        assert failed.status is failed_least.status is ToolStatus.ERROR, (failed, failed_least)
        assert guarded.status is ToolStatus.OK and guarded.stdout.strip() == solve(kind, q, code)
    # A recursion: past the 1,000 frames at levels 2 and 3 only, with the traceback SFT shows.
    deep, shallow = (
        next(p for p in (KINDS["recurrence"](random.Random(s), level) for s in range(50)) if "def a(n)" in p[1])
        for level in (3, 1)
    )
    failed, guarded, plain_shallow = execute_batch(
        [service.url], [(unguarded(deep[1]), ""), (deep[1], ""), (unguarded(shallow[1]), "")]
    )
    assert failed.status is ToolStatus.ERROR and failed.stderr.rstrip().endswith(
        "RecursionError: maximum recursion depth exceeded"
    )
    # the same traceback, its count of repeated frames to within one (it moves by one within a process)
    first, error = broken_program(deep[1], random.Random(0))
    repeats = re.compile(r"repeated (\d+) more times")
    assert first == unguarded(deep[1]) and repeats.sub("", error) == repeats.sub("", failed.stderr)
    assert abs(int(repeats.search(error)[1]) - int(repeats.search(failed.stderr)[1])) <= 1
    assert guarded.status is ToolStatus.OK and guarded.stdout.strip() == solve("recurrence", *deep)
    assert plain_shallow.status is ToolStatus.OK and plain_shallow.stdout.strip() == solve("recurrence", *shallow)


def test_cpu_loop_and_sleep_time_out(service: SandboxService) -> None:
    started = time.monotonic()
    results = execute_batch([service.url], [("while True:\n    pass", ""), ("import time\ntime.sleep(60)", "")])
    assert [r.status for r in results] == [ToolStatus.TIMEOUT, ToolStatus.TIMEOUT]
    assert all(r.wall_s <= LIMITS.timeout_s + 1 for r in results)
    assert time.monotonic() - started < LIMITS.timeout_s + 3


def test_memory_bomb(service: SandboxService) -> None:
    grow = "chunks = []\nwhile True:\n    chunks.append(bytearray(10**7))"
    results = execute_batch([service.url], [(grow, ""), ("bytearray(10**10)", "")])
    assert [r.status for r in results] == [ToolStatus.MEMORY, ToolStatus.MEMORY]
    assert "MemoryError" in results[0].stderr


def test_huge_output_is_cut_and_killed(service: SandboxService) -> None:
    results = execute_batch([service.url], [("print('x' * 10**6)", ""), ("while True:\n    print('spam')", "")])
    for result in results:
        assert result.status == ToolStatus.OUTPUT_LIMIT
        assert result.stdout.endswith(TRUNCATION_MARKER)
        assert len(result.stdout) <= LIMITS.output_bytes + len(TRUNCATION_MARKER)
    assert results[1].wall_s < LIMITS.timeout_s  # killed at the limit, not at the timeout


def test_signal_death_is_killed(service: SandboxService) -> None:
    result = execute(service.url, "import os, signal\nos.kill(os.getpid(), signal.SIGSEGV)")
    assert (result.status, result.exit_code) == (ToolStatus.KILLED, -11)


def test_background_child_does_not_hold_the_call(service: SandboxService) -> None:
    code = "import subprocess\nsubprocess.Popen(['sleep', '30'])\nprint('started')"
    result = execute(service.url, code)
    assert (result.status, result.stdout) == (ToolStatus.OK, "started\n")
    assert result.wall_s < LIMITS.timeout_s


def test_files_land_in_a_private_temp_dir_that_is_removed(service: SandboxService) -> None:
    code = (
        "import json, os\n"
        "open('out.txt', 'w').write('hello')\n"
        "print(json.dumps({'cwd': os.getcwd(), 'file': os.path.abspath('out.txt'),"
        " 'home': os.environ['HOME']}))"
    )
    result = execute(service.url, code)
    assert result.status == ToolStatus.OK, result.stderr
    seen = json.loads(result.stdout)
    cwd = Path(seen["cwd"])
    assert seen["home"] == seen["cwd"]
    assert PROJECT_ROOT not in [cwd, *cwd.parents]
    assert Path(seen["file"]).parent == cwd
    assert not cwd.exists()  # removed with everything in it once the call ended


def test_environment_is_scrubbed(service: SandboxService) -> None:
    result = execute(service.url, "import os, json\nprint(json.dumps(sorted(os.environ)))")
    names = set(json.loads(result.stdout))
    assert SECRET_NAME not in names
    assert names <= {
        "PATH",
        "LANG",
        "HOME",
        "TMPDIR",
        "PYTHONDONTWRITEBYTECODE",
        "OMP_NUM_THREADS",
        "OPENBLAS_NUM_THREADS",
    }


# ------------------------------------------------------------------------------------------------
# Service and client


def test_batch_returns_in_order_across_chunks(service: SandboxService) -> None:
    # Later calls finish first, and chunks of 3 travel as separate requests.
    calls = [(f"import time\ntime.sleep({0.05 * (7 - i)})\nprint({i})", "") for i in range(8)]
    results = execute_batch([service.url], calls, batch_size=3)
    assert [r.stdout for r in results] == [f"{i}\n" for i in range(8)]


def test_dead_url_gives_internal_without_raising() -> None:
    dead = f"http://127.0.0.1:{_free_port('127.0.0.1')}"
    results = execute_batch([dead], [("print(1)", ""), ("print(2)", "")], retries=2, backoff_s=0.01)
    assert [r.status for r in results] == [ToolStatus.INTERNAL] * 2
    assert all(r.stderr.startswith("sandbox unavailable:") for r in results)
    assert not results[0].status.is_failure


def test_no_replica_answering_for_outage_s_stops_the_caller() -> None:
    """A short outage comes back as INTERNAL; one longer than outage_timeout_s raises, so the attempt stops."""
    dead = [f"http://127.0.0.1:{_free_port('127.0.0.1')}" for _ in range(2)]

    async def go() -> tuple[ToolResult, BaseException | None]:
        async with SandboxClient(dead, retries=1, backoff_s=0.01, outage_timeout_s=0.3) as client:
            first = await client.execute("print(1)")
            await asyncio.sleep(0.4)
            try:
                await client.execute("print(2)")
            except SandboxOutage as outage:
                return first, outage
            return first, None

    first, outage = asyncio.run(go())
    assert first.status is ToolStatus.INTERNAL
    assert outage is not None and "no sandbox replica has answered for over 0 s" in str(outage)


def test_client_fails_over_from_a_dead_replica(service: SandboxService) -> None:
    dead = f"http://127.0.0.1:{_free_port('127.0.0.1')}"
    calls = [(f"print({i})", "") for i in range(4)]
    results = execute_batch([dead, service.url], calls, batch_size=1, retries=1, backoff_s=0.01)
    assert [r.stdout for r in results] == [f"{i}\n" for i in range(4)]


def test_bad_requests_name_the_field(service: SandboxService) -> None:
    async def post(path: str, data: str) -> tuple[int, str]:
        async with aiohttp.ClientSession() as session, session.post(service.url + path, data=data) as response:
            return response.status, (await response.json())["error"]

    async def go() -> list[tuple[int, str]]:
        return [
            await post("/execute", "not json"),
            await post("/execute", json.dumps({"code": 5})),
            await post("/execute", json.dumps({"code": "1", "input": ["x"]})),
            await post("/execute_batch", json.dumps({"requests": [{"code": "1"}, {"input": ""}]})),
            await post("/execute_batch", json.dumps({"requests": "print(1)"})),
            await post("/execute_batch", json.dumps({"requests": ["print(1)"]})),
        ]

    answers = asyncio.run(go())
    assert [status for status, _ in answers] == [400] * 6
    for (_, message), field in zip(
        answers, ["JSON", "'code'", "'input'", "'requests[1].code'", "'requests'", "'requests[0]'"]
    ):
        assert field in message


def test_full_queue_answers_503_instead_of_hanging() -> None:
    sleeper = json.dumps({"code": "import time\ntime.sleep(1)", "input": ""})

    Answer = tuple[int, dict, float]  # HTTP status, body, seconds to answer

    async def post(session: aiohttp.ClientSession, url: str, data: str) -> Answer:
        started = time.monotonic()
        async with session.post(url, data=data) as response:
            return response.status, await response.json(), time.monotonic() - started

    async def go(url: str) -> tuple[list[Answer], Answer]:
        async with aiohttp.ClientSession() as session:
            # One runs, one waits, the third finds the queue full.
            calls = [post(session, url + "/execute", sleeper) for _ in range(3)]
            answers = await asyncio.gather(*calls)
            too_big = json.dumps({"requests": [{"code": "1"}] * 3})
            return list(answers), await post(session, url + "/execute_batch", too_big)

    with SandboxService(workers=1, max_queue=1, limits=LIMITS) as busy:
        answers, too_big = asyncio.run(go(busy.url))
        stats = asyncio.run(_get_json(busy.url + "/stats"))
    statuses = sorted(status for status, _, _ in answers)
    assert statuses == [200, 200, 503]
    [(_, body, elapsed)] = [a for a in answers if a[0] == 503]
    assert body == {"error": "busy"} and elapsed < 1.0
    assert too_big[0] == 413 and "capacity" in too_big[1]["error"]
    assert stats["rejected"] == 1 and stats["done"] == 2


def test_health_and_stats(service: SandboxService) -> None:
    execute(service.url, "print('counted')")
    assert asyncio.run(_get_json(service.url + "/health"))["status"] == "ok"
    stats = asyncio.run(_get_json(service.url + "/stats"))
    assert stats["done"] >= 1 and stats["by_status"]["ok"] >= 1
    assert stats["in_flight"] == 0
    assert 0 < stats["latency_p50_s"] <= stats["latency_p99_s"]


def test_service_that_cannot_start_reports_why(service: SandboxService) -> None:
    taken = SandboxService(port=service.port, startup_timeout_s=15)
    with pytest.raises(RuntimeError, match="exited with code"):
        taken.start()


async def _get_json(url: str) -> dict:
    async with aiohttp.ClientSession() as session, session.get(url) as response:
        return await response.json()


def test_service_stops_when_its_parent_is_killed(tmp_path) -> None:
    """A pipeline killed with SIGKILL cannot stop its sandbox: the service notices and stops."""
    import signal
    import subprocess
    import sys
    import time

    script = (
        "import sys, time\nfrom tasks.sandbox.server import SandboxService\n"
        "box = SandboxService(workers=1).start()\nprint(box._process.pid, flush=True)\ntime.sleep(600)"
    )
    parent = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True, cwd=PROJECT_ROOT)
    server_pid = int(parent.stdout.readline())
    parent.send_signal(signal.SIGKILL)
    parent.wait()
    deadline = time.monotonic() + 15
    while Path(f"/proc/{server_pid}").exists() and time.monotonic() < deadline:
        time.sleep(0.2)
    stat = Path(f"/proc/{server_pid}/stat")
    assert not stat.exists() or stat.read_text().split(")")[1].split()[0] == "Z"


# ------------------------------------------------------------------------------------------------
# The run's credential


def test_a_call_without_the_runs_credential_gets_401_and_runs_nothing() -> None:
    with SandboxService(workers=1, limits=LIMITS, token="the-runs-secret") as box:

        async def go() -> tuple[list[int], int, int]:
            statuses = []
            async with aiohttp.ClientSession() as session:
                for headers in ({}, {"Authorization": "Bearer a-guess"}):
                    for path in ("/execute", "/execute_batch"):
                        body = {"code": "print(1)", "input": "", "requests": [{"code": "print(1)"}]}
                        async with session.post(box.url + path, json=body, headers=headers) as response:
                            statuses.append(response.status)
                    async with session.get(box.url + "/stats", headers=headers) as response:
                        statuses.append(response.status)
                async with session.get(box.url + "/health") as response:  # liveness needs none
                    health = response.status
                auth = {"Authorization": "Bearer the-runs-secret"}
                async with session.get(box.url + "/stats", headers=auth) as response:
                    done = (await response.json())["done"]
            return statuses, health, done

        statuses, health, done = asyncio.run(go())
        assert statuses == [401] * 6 and health == 200
        assert done == 0  # nothing ran
        # With it, through the client: the call runs, and the program cannot read the credential.
        program = f"import os\nprint(os.environ.get({TOKEN_ENV!r}))"
        (result,) = execute_batch([box.url], [(program, "")], token="the-runs-secret")
        assert (result.status, result.stdout.strip()) == (ToolStatus.OK, "None")
        with pytest.raises(SandboxRefused, match="HTTP 401"):  # loudly, not as `internal` tool calls
            execute_batch([box.url], [("print(1)", "")], token="another-runs-secret")


def test_the_service_refuses_a_network_address_without_a_credential(monkeypatch, capsys) -> None:
    monkeypatch.delenv(TOKEN_ENV, raising=False)
    with pytest.raises(SystemExit):
        main(["serve", "--host", "10.11.12.13"])
    assert f"set ${TOKEN_ENV}" in capsys.readouterr().err


def test_a_body_over_the_limit_is_refused_unread(service: SandboxService) -> None:
    async def post(size: int) -> int:
        async with aiohttp.ClientSession() as session:
            body = json.dumps({"code": "#" + "x" * size, "input": ""})
            async with session.post(service.url + "/execute", data=body) as response:
                return response.status

    assert asyncio.run(post(MAX_BODY_BYTES)) == 413
