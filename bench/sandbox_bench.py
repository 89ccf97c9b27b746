"""Sandbox service against a naive baseline, in one run: throughput and p50/p99 latency.

Cases: (a) `print(1+1)`, (b) a sympy factorisation, (c) a 1-second CPU loop; each at 1, 64 and
1,000 requests in flight (configurable). The sandbox side is a real `SandboxService` (forking
from its warm template) driven through `SandboxClient.execute`, one request per call, at most
`in_flight` at once. The baseline is `subprocess.run([python, "-c", code])` per call from a thread
pool of the same size (capped by --baseline-max-in-flight: a thousand fresh interpreters at once
need ~10 GB, and with sympy ~60 GB).

Every request's program ends with a bare expression holding its index, so each answer names the
request it belongs to: the bench checks that every request got exactly one answer, its own, and
that the server ran exactly as many calls as were sent (from /stats).

It first prints what the machine charges for page faults: a forked call is mostly faults, so the
ratios depend on the machine (on the 2-core VM of docs/benchmarks.md a fault costs 2-11 us).

    .venv/bin/python bench/sandbox_bench.py                    # default: a few minutes, 2 cores
    .venv/bin/python bench/sandbox_bench.py --scale 0.25 --in-flight 1,64,1000
"""

import argparse
import asyncio
import json
import mmap
import os
import subprocess
import sys
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tasks.records import ToolStatus  # noqa: E402
from tasks.sandbox.client import SandboxClient  # noqa: E402
from tasks.sandbox.executor import Limits  # noqa: E402
from tasks.sandbox.server import SandboxService  # noqa: E402

CASES = {
    "a": ("print(1+1)", "print(1+1)"),
    "b": (
        "sympy factor",
        "import sympy\nx, y = sympy.symbols('x y')\nprint(sympy.factor(x**6 - y**6 + 2*x**3 - 2*y**3))",
    ),
    "c": (
        "1 s CPU loop",
        "import time\nt = time.process_time()\nwhile time.process_time() - t < 1.0:\n    pass",
    ),
}

# Requests per (case, in-flight level) at --scale 1; at least the level itself so that the
# level is really reached, except where marked smaller (then the table shows the real level).
DEFAULT_REQUESTS = {
    "a": {"sandbox": 400, "baseline": 200},
    "b": {"sandbox": 128, "baseline": 64},
    "c": {"sandbox": 8, "baseline": 8},
}


def percentile(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))]


def program(case: str, i: int) -> str:
    return f"{CASES[case][1]}\n{i}"


def expected_tail(i: int) -> str:
    return f"{i}\n"


async def run_sandbox(url: str, case: str, n: int, in_flight: int) -> dict:
    latencies: list[float] = []
    answers: dict[int, int] = {}
    bad: list[str] = []
    gate = asyncio.Semaphore(in_flight)

    async with SandboxClient([url], timeout_s=3600, retries=10) as client:

        async def one(i: int) -> None:
            async with gate:
                started = time.perf_counter()
                result = await client.execute(program(case, i), "")
                latencies.append(time.perf_counter() - started)
            answers[i] = answers.get(i, 0) + 1
            if result.status != ToolStatus.OK or not result.stdout.endswith(expected_tail(i)):
                bad.append(f"#{i}: {result.status.value} {result.stdout[-40:]!r} {result.stderr[-200:]!r}")

        started = time.perf_counter()
        await asyncio.gather(*(one(i) for i in range(n)))
        elapsed = time.perf_counter() - started
    return summary(n, elapsed, latencies, answers, bad)


def run_baseline(python: str, case: str, n: int, in_flight: int) -> dict:
    latencies: list[float] = []
    answers: dict[int, int] = {}
    bad: list[str] = []

    # The baseline runs the program as written: no echo of the bare expression, so print it.
    def one(i: int) -> None:
        code = f"{CASES[case][1]}\nprint({i})"
        started = time.perf_counter()
        done = subprocess.run(
            [python, "-c", code], capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"}
        )
        latencies.append(time.perf_counter() - started)
        answers[i] = answers.get(i, 0) + 1
        if done.returncode != 0 or not done.stdout.endswith(expected_tail(i)):
            bad.append(f"#{i}: rc {done.returncode} {done.stderr[-200:]!r}")

    started = time.perf_counter()
    with ThreadPoolExecutor(max_workers=in_flight) as pool:
        list(pool.map(one, range(n)))
    elapsed = time.perf_counter() - started
    return summary(n, elapsed, latencies, answers, bad)


def summary(n: int, elapsed: float, latencies: list[float], answers: dict, bad: list) -> dict:
    lost = [i for i in range(n) if answers.get(i, 0) == 0]
    duplicated = [i for i, k in answers.items() if k > 1]
    return {
        "n": n,
        "throughput": n / elapsed,
        "p50": percentile(latencies, 0.50),
        "p99": percentile(latencies, 0.99),
        "lost": len(lost),
        "duplicated": len(duplicated),
        "bad": bad,
    }


def server_done(url: str) -> int:
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    with opener.open(url + "/stats", timeout=10) as response:
        return json.load(response)["done"]


def page_fault_costs(pages: int = 16384) -> dict:
    """What this machine charges for the page work a forked call is made of (us a fault; ms a
    fork). Two thirds of a small sandbox call's CPU is the kernel's, a quarter of the baseline's,
    so the ratios move with these: natively a fault costs well under 1 us; under nested
    virtualisation many times that."""
    size = pages * mmap.PAGESIZE

    def touch(buf: mmap.mmap) -> float:
        started = time.perf_counter()
        for offset in range(0, size, mmap.PAGESIZE):
            buf[offset] = 1
        return time.perf_counter() - started

    buf = mmap.mmap(-1, size)
    first = touch(buf)
    loop = touch(buf)  # the same writes without faults: the Python loop's own cost
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:
        copied = touch(buf)
        os.write(write, str(copied - touch(buf)).encode())
        os._exit(0)
    os.waitpid(pid, 0)
    copy_on_write = float(os.read(read, 64))
    os.close(read)
    os.close(write)
    started = time.perf_counter()
    for _ in range(100):
        pid = os.fork()
        if pid == 0:
            os._exit(0)
        os.waitpid(pid, 0)
    fork_ms = (time.perf_counter() - started) * 10
    with open("/proc/self/statm") as f:
        rss_mb = int(f.read().split()[1]) * mmap.PAGESIZE >> 20
    buf.close()
    return {
        "first_touch_us": (first - loop) / pages * 1e6,
        "copy_on_write_us": copy_on_write / pages * 1e6,
        "fork_ms": fork_ms,
        "rss_mb": rss_mb,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--cases", default="a,b,c")
    parser.add_argument("--in-flight", default="1,64,1000", help="comma-separated levels")
    parser.add_argument("--scale", type=float, default=1.0, help="multiply the request counts")
    parser.add_argument(
        "--requests", type=int, default=None, help="sandbox requests per (case, level), overriding defaults"
    )
    parser.add_argument("--baseline-requests", type=int, default=None)
    parser.add_argument(
        "--baseline-max-in-flight", type=int, default=256, help="most fresh interpreters at once in the baseline"
    )
    parser.add_argument("--workers", type=int, default=4, help="sandbox programs running at once")
    parser.add_argument("--no-baseline", action="store_true")
    args = parser.parse_args()
    levels = [int(x) for x in args.in_flight.split(",")]
    cases = args.cases.split(",")

    costs = page_fault_costs()
    print(
        f"machine: a first-touch page fault {costs['first_touch_us']:.2f} us, a copy-on-write fault "
        f"{costs['copy_on_write_us']:.2f} us, fork + exit of this "
        f"process ({costs['rss_mb']} MB resident) {costs['fork_ms']:.2f} ms",
        flush=True,
    )
    rows = []
    limits = Limits(timeout_s=30.0, cpu_s=10, memory_mb=1024)
    with SandboxService(workers=args.workers, limits=limits, max_queue=max(levels) + 64) as box:
        for case in cases:
            for level in levels:
                n = max(1, round((args.requests or DEFAULT_REQUESTS[case]["sandbox"]) * args.scale))
                if level >= 1000 and case == "a":
                    n = max(n, level)  # the exactly-once check at the full level
                done_before = server_done(box.url)
                sandbox = asyncio.run(run_sandbox(box.url, case, n, level))
                sandbox["server_ran"] = server_done(box.url) - done_before
                sandbox["level"] = min(level, n)
                row = {"case": case, "level": level, "sandbox": sandbox, "baseline": None}
                if not args.no_baseline:
                    bn = args.baseline_requests or DEFAULT_REQUESTS[case]["baseline"]
                    bn = max(1, min(n, round(bn * args.scale)))
                    blevel = min(level, args.baseline_max_in_flight, bn)
                    row["baseline"] = run_baseline(sys.executable, case, bn, blevel)
                    row["baseline"]["level"] = blevel
                rows.append(row)
                print_row(row, flush=True)

    print()
    print_table(rows)
    problems = [
        (r["case"], r["level"])
        for r in rows
        if r["sandbox"]["lost"]
        or r["sandbox"]["duplicated"]
        or r["sandbox"]["bad"]
        or r["sandbox"]["server_ran"] != r["sandbox"]["n"]
    ]
    if problems:
        for r in rows:
            for line in r["sandbox"]["bad"][:5]:
                print(f"  {r['case']}@{r['level']}: {line}")
        sys.exit(f"answer check FAILED for {problems}")
    print("every request answered exactly once, with its own answer; server ran each exactly once")


def print_row(row: dict, flush: bool = False) -> None:
    s, b = row["sandbox"], row["baseline"]
    line = (
        f"[{row['case']} @ {row['level']}] sandbox n={s['n']} {s['throughput']:.1f}/s "
        f"p50 {s['p50']:.3f}s p99 {s['p99']:.3f}s lost {s['lost']} dup {s['duplicated']} "
        f"ran {s['server_ran']} bad {len(s['bad'])}"
    )
    if b:
        line += (
            f" | baseline n={b['n']} @ {b['level']} {b['throughput']:.1f}/s "
            f"p50 {b['p50']:.3f}s p99 {b['p99']:.3f}s bad {len(b['bad'])}"
        )
    print(line, file=sys.stderr, flush=flush)


def print_table(rows: list[dict]) -> None:
    header = (
        f"{'case':<14} {'in flight':>9} | {'n':>5} {'@':>4} {'req/s':>8} {'p50 s':>7} "
        f"{'p99 s':>7} | "
        f"{'base n':>6} {'@':>4} {'req/s':>7} {'p50 s':>7} {'p99 s':>7} | {'x thr':>6} "
        f"{'answered once':>13}"
    )
    print("in flight: requested level; @: real level (fewer requests than the level caps it);")
    print("x thr: sandbox throughput / baseline throughput")
    print(header)
    print("-" * len(header))
    for r in rows:
        s, b = r["sandbox"], r["baseline"]
        once = "yes" if not (s["lost"] or s["duplicated"]) and s["server_ran"] == s["n"] else "NO"
        text = (
            f"{CASES[r['case']][0]:<14} {r['level']:>9} | {s['n']:>5} {s['level']:>4} "
            f"{s['throughput']:>8.1f} "
            f"{s['p50']:>7.3f} {s['p99']:>7.3f} | "
        )
        if b:
            text += (
                f"{b['n']:>6} {b['level']:>4} {b['throughput']:>7.1f} {b['p50']:>7.3f} "
                f"{b['p99']:>7.3f} | {s['throughput'] / b['throughput']:>6.1f}"
            )
        else:
            text += f"{'-':>6} {'-':>4} {'-':>7} {'-':>7} {'-':>7} | {'-':>6}"
        print(text + f" {once:>13}")


if __name__ == "__main__":
    main()
