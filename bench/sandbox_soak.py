"""Soak test of the sandbox service (not in the default suite): many calls, none lost or
duplicated, and the service's memory flat.

Starts a real `SandboxService` on 127.0.0.1, sends `--calls` programs through `SandboxClient`
(`--in-flight` at once, in batches of `--batch`), and checks that each answer is its own
request's (every program echoes its index). Prints the resident memory (RSS) of the server and of
the template and cells at the start, after every tenth of the calls, and at the end.

With `--kill-every S` the service runs as a run's sandbox replicas do: `--replicas` Ray actors
on a local Ray (127.0.0.1), each with its server, and every S seconds the last replica's actor
and server are SIGKILLed (as when its node goes). Ray restarts it, the client retries the calls
it held on the others and finds the replica's new address. A call answered `internal` (the
outage reached the caller) counts as lost; memory is that of the replica never killed and of
this process (the client).

    .venv/bin/python bench/sandbox_soak.py                       # 100,000 calls, ~15 min on 2 cores
    .venv/bin/python bench/sandbox_soak.py --calls 5000
    .venv/bin/python bench/sandbox_soak.py --replicas 2 --kill-every 5
"""

import argparse
import asyncio
import json
import os
import secrets
import signal
import sys
import threading
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path

from tqdm import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import tasks.cluster  # noqa: E402, F401  (before Ray: a local Ray on 127.0.0.1)
from tasks.records import ToolStatus  # noqa: E402
from tasks.sandbox.client import SandboxClient  # noqa: E402
from tasks.sandbox.limits import Limits  # noqa: E402
from tasks.sandbox.server import SandboxService  # noqa: E402

# A mix of what rollouts send: plain arithmetic, an exception, a sympy call, printing.
PROGRAMS = (
    "x = {i} * 3\nprint(x // 3)",
    "import math\nprint(math.factorial(20) % 7 + {i} - {i}, end='')\nprint()\nprint({i})",
    "try:\n    1 / 0\nexcept ZeroDivisionError:\n    pass\nprint({i})",
    "import sympy\nprint(sympy.isprime(97))\nprint({i})",
)


def rss_mb(pid: int | None) -> float:
    if pid is None:
        return 0.0
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return 0.0


def stats(url: str, token: str | None = None) -> dict:
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    with opener.open(urllib.request.Request(url + "/stats", headers=headers), timeout=10) as response:
        return json.load(response)


def memory(url: str, server_pid: int | None, token: str | None = None) -> dict:
    template = stats(url, token)["template"] or {}
    return {
        "server_mb": rss_mb(server_pid),
        "template_mb": rss_mb(template.get("pid")),
        "cells_mb": [round(rss_mb(pid), 1) for pid in template.get("cells", [])],
        "client_mb": rss_mb(os.getpid()),
    }


async def soak(client: SandboxClient, memory: Callable[[], dict], calls: int, in_flight: int, batch: int) -> dict:
    answers = [0] * calls
    wrong: list[str] = []
    samples = [("start", 0, memory())]
    gate = asyncio.Semaphore(max(1, in_flight // batch))
    checkpoint = max(1, calls // 10)
    done = 0
    progress = tqdm(total=calls, unit="call", desc="soak")

    async with client:

        async def chunk(start: int) -> None:
            nonlocal done
            indices = range(start, min(calls, start + batch))
            async with gate:
                results = await client.execute_batch([(PROGRAMS[i % len(PROGRAMS)].format(i=i), "") for i in indices])
            for i, result in zip(indices, results):
                answers[i] += 1
                if result.status != ToolStatus.OK or not result.stdout.endswith(f"{i}\n"):
                    wrong.append(f"#{i}: {result.status.value} {result.stderr[-200:]!r}")
            before = done
            done += len(indices)
            progress.update(len(indices))
            if done // checkpoint != before // checkpoint:
                samples.append(("calls", done, memory()))

        started = time.perf_counter()
        await asyncio.gather(*(chunk(s) for s in range(0, calls, batch)))
        elapsed = time.perf_counter() - started
    progress.close()
    samples.append(("end", calls, memory()))
    return {
        "elapsed_s": elapsed,
        "lost": sum(1 for a in answers if a == 0),
        "duplicated": sum(1 for a in answers if a > 1),
        "wrong": wrong,
        "samples": samples,
    }


def with_replicas(args: argparse.Namespace) -> tuple[dict, int, int]:
    """The soak over Ray actor replicas, the last killed every args.kill_every s; returns the
    report, the calls the replicas ran and the kills."""
    import ray

    from tasks.cluster.sandboxes import SandboxActor, SandboxGroup

    ray.init(address="local", num_cpus=4, include_dashboard=False, _node_ip_address="127.0.0.1")
    log_dir = Path("outputs/bench/sandbox-soak")
    replica = ray.remote(SandboxActor).options(num_cpus=0.5, max_restarts=-1)
    token = secrets.token_urlsafe(32)
    replicas = [replica.remote(i, args.workers, Limits(), str(log_dir), token, True) for i in range(args.replicas)]
    group = SandboxGroup(replicas, 120)
    kept = ray.get(group.actors[0].where.remote())
    stop, kills = threading.Event(), [0]

    def kill_the_last() -> None:
        while not stop.wait(args.kill_every):
            where = group.resolve(args.replicas - 1) and ray.get(group.actors[-1].where.remote())
            if where:
                for pid in (where["pid"], where["server_pid"]):
                    os.kill(pid, signal.SIGKILL)
                kills[0] += 1

    killer = threading.Thread(target=kill_the_last, daemon=True)
    killer.start()
    try:
        client = SandboxClient(group.urls, timeout_s=600, batch_size=args.batch, resolve=group.resolve, token=token)
        report = asyncio.run(
            soak(client, lambda: memory(kept["url"], kept["server_pid"], token), args.calls, args.in_flight, args.batch)
        )
        report["retried"] = client.retried
        stop.set()
        killer.join()
        ran = sum(stats(group.resolve(i), token)["done"] for i in range(args.replicas))
    finally:
        group.stop()
        ray.shutdown()
    return report, ran, kills[0]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--calls", type=int, default=100_000)
    parser.add_argument("--in-flight", type=int, default=256)
    parser.add_argument("--batch", type=int, default=32, help="calls per /execute_batch request")
    parser.add_argument("--workers", type=int, default=4, help="programs at once, per replica")
    parser.add_argument("--replicas", type=int, default=2, help="with --kill-every: Ray actor replicas")
    parser.add_argument("--kill-every", type=float, default=None, help="SIGKILL the last replica every S s")
    args = parser.parse_args()

    kills = 0
    if args.kill_every:
        report, ran, kills = with_replicas(args)
    else:
        with SandboxService(workers=args.workers, max_queue=args.in_flight + 64) as box:
            client = SandboxClient([box.url], timeout_s=600, retries=20, batch_size=args.batch)
            report = asyncio.run(soak(client, lambda: memory(box.url, box.pid), args.calls, args.in_flight, args.batch))
            ran = stats(box.url)["done"]

    print(
        f"\n{args.calls} calls in {report['elapsed_s']:.0f} s "
        f"({args.calls / report['elapsed_s']:.1f}/s); servers ran {ran}"
        + (
            f" (the killed replica's runs before each kill not counted); {kills} kills, {report['retried']} retries"
            if kills
            else ""
        )
    )
    print(f"{'when':>10} {'server MB':>10} {'template MB':>12} {'client MB':>10}  cells MB")
    for label, n, mem in report["samples"]:
        when = label if label != "calls" else f"{n}"
        print(
            f"{when:>10} {mem['server_mb']:>10.1f} {mem['template_mb']:>12.1f} {mem['client_mb']:>10.1f}  "
            f"{mem['cells_mb']}"
        )
    print(f"lost {report['lost']}, duplicated {report['duplicated']}, wrong answers {len(report['wrong'])}")
    for line in report["wrong"][:10]:
        print("  " + line)
    if report["lost"] or report["duplicated"] or report["wrong"] or (not kills and ran != args.calls):
        sys.exit("soak FAILED")


if __name__ == "__main__":
    main()
