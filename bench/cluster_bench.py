"""The Ray runtime's costs, as ratios measured in one run on this machine:

(a) --flow: the tiny default's whole flow (`rstar2 run`) on the Ray runtime against a checkout of
    the commit before it (--baseline, run from a git worktree with the same venv): target <= 1.10x.
(b) weight sync, trainer rank 0 -> 2 engine actors, for the tiny model and a ~100M-parameter one:
    seconds and bytes/s per sync, gloo group against Ray's object store (median of --repeats).
(c) actor-call overhead of an RL step on the tiny model: the round trip of an empty call to an
    engine actor and to a rank actor, times the calls the step made, as a share of the step.

    .venv/bin/python bench/cluster_bench.py [--flow --baseline 7a31666] [--repeats 3]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import tasks.cluster  # noqa: E402, F401  (before ray: a local Ray on 127.0.0.1)
from tasks.config import TinyModelConfig, default_config_path, load_config  # noqa: E402
from tasks.data.problems import generate_problems  # noqa: E402
from tasks.train.tiny_model import build_tiny_model  # noqa: E402

MODELS = {
    "tiny": TinyModelConfig(hidden_size=192, num_layers=4, num_heads=3, num_kv_heads=3, intermediate_size=512),
    "100M": TinyModelConfig(hidden_size=768, num_layers=16, num_heads=12, num_kv_heads=4, intermediate_size=2048),
}


def build(name: str, out: Path) -> Path:
    corpus = [p.question + "\n" + p.solution_code for p in generate_problems(256, [1, 2, 3], seed=0)]
    return build_tiny_model(MODELS[name], corpus, seed=0, out_dir=out / name)


def runtime_config(model_dir: Path, engines: int):
    return load_config(
        default_config_path(),
        {
            "model.path": str(model_dir),
            "engines.kv_cache_gib": 0.1,
            "engines.count": engines,
            "cluster.num_cpus": 4,  # logical: the actors take turns on the cores
            "sandbox.workers": 1,
        },
    )


def parameters(model_dir: Path) -> int:
    from tasks.rollout.engine import weights_from_dir

    return sum(tensor.numel() for _, tensor in weights_from_dir(model_dir))


def bench_sync(work: Path, repeats: int) -> None:
    from tasks.cluster.sync import WeightSync
    from tasks.runtime import Runtime

    print("(b) weight sync, trainer rank 0 -> 2 engine actors (median of", repeats, "syncs)")
    print(f"{'model':>6} {'params':>8} {'MB':>7} {'backend':>13} {'s/sync':>8} {'MB/s':>8}")
    for name in MODELS:
        model_dir = build(name, work)
        cfg = runtime_config(model_dir, engines=2)
        with Runtime(cfg, model_dir, work / f"run-{name}") as runtime:
            runtime.policy_trainer(total_steps=1, reset_optimizer=False)
            for backend in ("gloo", "object_store"):
                sync = WeightSync(
                    runtime.trainer, runtime.engines, cfg.cluster.model_copy(update={"weight_sync": backend})
                )
                sync.push()  # the first one sets up the group and the layout
                times = [sync.push()["seconds"] for _ in range(repeats)]
                mb = sync.last["bytes"] / 1e6
                seconds = statistics.median(times)
                size = f"{name:>6} {parameters(model_dir) / 1e6:>7.1f}M {mb:>7.1f}"
                print(f"{size} {backend:>13} {seconds:>8.3f} {mb / seconds:>8.1f}")


def round_trip(call, n: int = 200) -> float:
    import ray

    ray.get(call())
    started = time.perf_counter()
    for _ in range(n):
        ray.get(call())
    return (time.perf_counter() - started) / n


def bench_overhead(work: Path) -> None:
    from transformers import AutoTokenizer

    from tasks.records import Sample
    from tasks.rl.batch import step_problems
    from tasks.rollout.agent import run_rollouts
    from tasks.runtime import Runtime

    model_dir = build("tiny", work)
    cfg = runtime_config(model_dir, engines=1)
    stage = cfg.rl.stages[0]
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    problems = generate_problems(64, [1, 2, 3], seed=7)
    with Runtime(cfg, model_dir, work / "run-overhead") as runtime:
        trainer = runtime.policy_trainer(total_steps=4, reset_optimizer=False)
        engine_rtt = round_trip(lambda: runtime.engines.actors[0].take.remote(0.0))
        rank_rtt = round_trip(lambda: runtime.trainer.actors[0].where.remote())
        print("(c) actor-call overhead per RL step, tiny model, one engine and one rank")
        print(f"    empty call: engine actor {engine_rtt * 1e3:.2f} ms, rank actor {rank_rtt * 1e3:.2f} ms")
        for step in range(2):
            batch = step_problems(problems, stage.problems_per_step, cfg.seed, stage.name, step)
            started, calls = time.perf_counter(), runtime.engines.calls
            trajectories, _ = run_rollouts(
                runtime.engines,
                runtime.tools,
                tokenizer,
                [(p.problem_id, p.question) for p in batch],
                cfg.rl.rollouts_per_problem,
                cfg.rollout.spec(stage),
            )
            rollout_s, engine_calls = time.perf_counter() - started, runtime.engines.calls - calls
            samples = [
                Sample(t.prompt_ids + t.response_ids, [0] * len(t.prompt_ids) + t.loss_mask, (-1.0) ** i)
                for i, t in enumerate(trajectories)
            ]
            started = time.perf_counter()
            trainer.rl_step(samples, cfg.rl.loss, stage.temperature)
            runtime.sync_weights(samples[:2])
            update_s = time.perf_counter() - started
            # Per step besides the rollouts: rl_step, weight layout/put/broadcast, load, 2 x logprobs.
            other_calls = 6
            overhead = engine_calls * engine_rtt + other_calls * rank_rtt
            total = rollout_s + update_s
            print(
                f"    step {step}: {len(trajectories)} rollouts {rollout_s:.1f} s ({engine_calls} engine calls), "
                f"update+sync {update_s:.1f} s; call overhead ~{overhead:.2f} s = {overhead / total:.1%} of the step"
            )


def pass_at_1(output_dir: Path, run_id: str) -> str:
    stages = json.loads((output_dir / "runs" / run_id / "summary.json").read_text())["stages"]
    return " -> ".join(f"{row['pass@1 after']:.3f}" for row in stages if row["pass@1 after"] is not None)


def timed_run(cwd: Path, output_dir: Path, run_id: str) -> float:
    env = {**os.environ, "PYTHONPATH": str(cwd), "PREFECT_HOME": str(output_dir / "prefect"), "OMP_NUM_THREADS": "1"}
    command = [sys.executable, "-m", "flows.cli", "run", "--run-id", run_id, "--set", f"output_dir={output_dir}"]
    started = time.perf_counter()
    subprocess.run(command, cwd=cwd, env=env, check=True, stdout=subprocess.DEVNULL)
    return time.perf_counter() - started


def bench_flow(work: Path, baseline: str) -> None:
    tree = work / "baseline"
    subprocess.run(["git", "worktree", "add", "--detach", str(tree), baseline], cwd=ROOT, check=True)
    try:
        before = timed_run(tree, work / "out-baseline", "bench-baseline")
        after = timed_run(ROOT, work / "out-ray", "bench-ray")
    finally:
        subprocess.run(["git", "worktree", "remove", "--force", str(tree)], cwd=ROOT, check=True)
    print(f"(a) tiny default flow: {baseline} {before:.0f} s, Ray runtime {after:.0f} s: ", end="")
    print(f"{after / before:.2f}x (target <= 1.10x)")
    for name, run_id in ((baseline, "bench-baseline"), ("Ray runtime", "bench-ray")):
        print(f"    held-out pass@1 after each stage, {name}: {pass_at_1(work / f'out-{run_id[6:]}', run_id)}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--flow", action="store_true", help="(a): two whole tiny runs, ~25 minutes on 2 cores")
    parser.add_argument("--baseline", default="7a31666", help="the commit (a) compares against")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="cluster-bench-") as tmp:
        work = Path(tmp)
        if args.flow:
            bench_flow(work, args.baseline)
        bench_sync(work, args.repeats)
        bench_overhead(work)


if __name__ == "__main__":
    main()
