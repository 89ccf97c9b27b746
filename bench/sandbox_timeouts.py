"""A group's programs that run out of time, ahead of short calls: batch makespan by sandbox workers.

In stage 1 the 16 samples of one problem often write the same program, and when that program
never ends (a tower of powers, `5**9**9190`) they all run to the wall-clock limit at once. A
replica runs `workers` programs at a time, so the short calls behind them wait whole timeouts.
This sends `--hangs` such programs and `--short` short ones (a digit-limit program of the
default's kinds) as one batch, the hangs first, to a real `SandboxService` per worker count under
`--config`'s limits (the default's: 4 s), and prints the makespan, the short calls' latency, the
replica's memory and the ratio against the first worker count (the baseline, measured in the
same run).

    .venv/bin/python bench/sandbox_timeouts.py                         # workers 2,4,8,16
    .venv/bin/python bench/sandbox_timeouts.py --workers 2,16 --hangs 16
"""

import argparse
import asyncio
import sys
import time
from pathlib import Path

import psutil

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tasks.cluster.actors import sandbox_limits  # noqa: E402
from tasks.config import load_config  # noqa: E402
from tasks.records import ToolStatus  # noqa: E402
from tasks.sandbox.client import SandboxClient  # noqa: E402
from tasks.sandbox.server import SandboxService  # noqa: E402

HANG = "import sys\nsys.set_int_max_str_digits(0)\nprint(str(9**9199 * 5**9**9190)[-1])"
SHORT = "import sys\nsys.set_int_max_str_digits(0)\nprint(str(7**12345)[-1])"


async def batch(url: str, hangs: int, short: int) -> tuple[float, list[float], set[str]]:
    async with SandboxClient([url], timeout_s=3600) as client:
        short_latencies: list[float] = []
        hang_statuses: set[str] = set()

        async def one(code: str) -> None:
            started = time.perf_counter()
            result = await client.execute(code, "")
            if code is HANG:
                hang_statuses.add(result.status.value)
                return
            if result.status != ToolStatus.OK or result.stdout.strip() != "7":
                raise RuntimeError(f"a short call came back {result.status.value}: {result.stderr[-200:]!r}")
            short_latencies.append(time.perf_counter() - started)

        started = time.perf_counter()
        await asyncio.gather(*(one(code) for code in [HANG] * hangs + [SHORT] * short))
        return time.perf_counter() - started, sorted(short_latencies), hang_statuses


def proportional_mb(pid: int) -> float:
    """The replica's memory with the pages its cells share with their template counted once
    (PSS): the sum of their RSS counts each shared page once per cell."""
    root = psutil.Process(pid)
    return sum(p.memory_full_info().pss for p in [root, *root.children(recursive=True)]) / 2**20


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--workers", default="2,4,8,16", help="comma-separated; the first is the baseline")
    parser.add_argument("--hangs", type=int, default=9, help="programs that run to the limit")
    parser.add_argument("--short", type=int, default=100)
    parser.add_argument("--config", default="configs/tiny.yaml", help="whose sandbox limits the programs run under")
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()
    limits = sandbox_limits(load_config(args.config).sandbox)
    baseline = None
    print("| workers | makespan s | short calls p50 / max s | memory MB idle (PSS) | ratio to baseline |")
    print("|---|---|---|---|---|")
    for workers in [int(w) for w in args.workers.split(",")]:
        with SandboxService(workers=workers, limits=limits, max_queue=args.hangs + args.short) as box:
            asyncio.run(batch(box.url, 0, 8))  # every cell forked once
            idle_mb = proportional_mb(box.pid)
            for _ in range(args.repeats):
                makespan, short, statuses = asyncio.run(batch(box.url, args.hangs, args.short))
                if statuses != {"timeout"}:
                    sys.exit(f"the hanging program came back {sorted(statuses)}, not a timeout")
                baseline = baseline or makespan
                print(
                    f"| {workers} | {makespan:.1f} | {short[len(short) // 2]:.2f} / {short[-1]:.2f} | "
                    f"{idle_mb:.0f} | {makespan / baseline:.2f} |",
                    flush=True,
                )


if __name__ == "__main__":
    main()
