"""Step time of the tiny default's stage 1 under rl.async, on this machine's cores, from one SFT
policy.

Four runs, one after another, all from the same SFT policy (the first run trains it, the others
start from a copy of its run folder; with --sft-from every run starts from a copy of that run's):
- off, colocated: the default placement, engine, trainer rank (2 threads) and sandbox sharing
  every core and taking turns;
- off, split: the engine bound to core 0, the trainer rank (1 thread) to the others
  (cluster.placement split);
- one_step, split: the engine draws step t+1 while step t's update runs;
- bounded (max_staleness 2), split: and goes on into step t+2 while the update still runs.

Prints per run the mean step time over steps 1..N-1 (an async run's step 0 has nothing drawn
ahead), the trainer's and the engines' idle fractions, the staleness, and each run's step time
against off split (the target: one_step at most 0.77x) and against off colocated.

    .venv/bin/python bench/async_bench.py [--steps 10] [--output-dir outputs/bench-async]
        [--sft-from outputs/runs/<a run of the default config, seed 0, past its SFT>]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from flows.cli import main as rstar2  # noqa: E402
from tasks.config import default_config_path, load_config  # noqa: E402
from tasks.store.run_folder import start_from_run  # noqa: E402
from tasks.store.tables import stage_steps  # noqa: E402

SPLIT = {"cluster.placement": "split", "trainer.threads": 1}
ARMS = {
    "off-colocated": {},
    "off-split": SPLIT,
    "one_step-split": {**SPLIT, "rl.async": {"mode": "one_step"}, "rl.loss.is_cap": 2.0},
    "bounded2-split": {**SPLIT, "rl.async": {"mode": "bounded", "max_staleness": 2}, "rl.loss.is_cap": 2.0},
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=10, help="stage 1 steps per run")
    parser.add_argument("--output-dir", default="outputs/bench-async")
    parser.add_argument("--sft-from", type=Path, default=None, help="a run folder: its SFT policy for every run")
    args = parser.parse_args()
    stage1 = load_config(default_config_path()).rl.stages[0].model_dump() | {"steps": args.steps}
    common = {"output_dir": args.output_dir, "rl.stages": [stage1]}
    runs = Path(args.output_dir) / "runs"
    results = {}
    for arm, overrides in ARMS.items():
        run_overrides = {**common, **overrides}
        source = args.sft_from or (runs / "off-colocated" if arm != "off-colocated" else None)
        if source is not None:
            start_from_run(source, runs / arm, load_config(default_config_path(), run_overrides), "sft")
        started = time.perf_counter()
        rstar2(["run", "--run-id", arm, *(f"--set={k}={json.dumps(v)}" for k, v in run_overrides.items())])
        steps = list(stage_steps(runs / arm, "stage1").values())[1:]
        results[arm] = {
            "step_s": statistics.fmean(s["time_step_s"] for s in steps),
            "trainer_idle": statistics.fmean(s["idle/trainer"] for s in steps),
            "engines_idle": statistics.fmean(s["idle/engines"] for s in steps),
            "staleness": statistics.fmean(s["staleness/mean"] for s in steps),
            "update_s": statistics.fmean(s.get("time_update_s", 0.0) for s in steps),
            "run_s": time.perf_counter() - started,
        }
    base, colocated = results["off-split"]["step_s"], results["off-colocated"]["step_s"]
    print(f"\nstage 1, steps 1..{args.steps - 1} of {args.steps}, one run each, from one SFT policy")
    print(
        f"{'run':<16} {'step s':>7} {'update s':>9} {'trainer idle':>12} {'engines idle':>12} {'staleness':>9} "
        f"{'vs off split':>12} {'vs colocated':>12}"
    )
    for arm, r in results.items():
        print(
            f"{arm:<16} {r['step_s']:>7.2f} {r['update_s']:>9.2f} {r['trainer_idle']:>12.2f} "
            f"{r['engines_idle']:>12.2f} {r['staleness']:>9.2f} {r['step_s'] / base:>11.2f}x "
            f"{r['step_s'] / colocated:>11.2f}x"
        )


if __name__ == "__main__":
    main()
