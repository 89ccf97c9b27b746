"""The engine's step cost, measured on a real vLLM engine, for bench/scheduler_sim.py.

One engine of `--model` (a model directory: the bench's outputs/bench/rollout-model, or a run's
models/<checkpoint>) in this process, with the run config's engine settings and one thread, as an
engine actor runs, and a KV cache that holds every batch (a step's cost does not depend on the
cache's size; preemptions would add recomputation to the steps measured). Batches of `n`
requests of `L` random prompt tokens (no prefix shared) decode `--new-tokens` tokens each; every
engine step is timed and described by what vLLM's scheduler put in it: the requests it ran, the
context they attend to, and the prompt tokens it prefilled. A least-squares fit over all steps
gives the simulator's engine model,

    step s = step_base_s + step_per_seq_s x requests + step_per_context_token_s x context
             + prefill_per_token_s x prefilled

printed with its residuals by batch size and written as JSON (`--out`), which
`bench/scheduler_sim.py --hardware` reads.

    .venv/bin/python bench/engine_calibration.py --model outputs/bench/rollout-model \
        --out outputs/bench/calibration-bench.json        # ~1 min
    .venv/bin/python bench/engine_calibration.py --model outputs/runs/<run>/models/sft \
        --out outputs/bench/calibration-default.json
    .venv/bin/python bench/engine_calibration.py --pool trace.json \
        --alone outputs/bench/calibration-bench.json --out calibration-pool.json

`--pool`: the engine's cost fitted instead on the engines of the real pool's runs, each run's and
engine's stepped seconds and steps (bench/rollout_bench.py --trace-out) against the sums of its
turns' terms: the step's cost where the engine shares its cores with the driver, the sandbox and
Ray, which an engine alone (`--alone`, this script's `--model` output) does not see.
`--pool-fit uniform` (the default) scales all four of the engine alone's terms by one factor;
`terms` refits the step's fixed and per-request terms and keeps the alone's per-token ones. Runs
with a preemption are left out of either fit (what they recompute is not in the traces). Fitted on
one run of the benches and replayed on either, `uniform` kept every cell within ±13.7% and
`terms` within ±15.3% (docs/benchmarks.md, 2026-12-04).
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from pathlib import Path

import numpy as np
from tqdm import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tasks.config import default_config_path, load_config  # noqa: E402
from tasks.rollout.engine import Engine, configure_cpu_runtime  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from scheduler_sim import ENGINE_COSTS, PromptSharing  # noqa: E402  (ENGINE_COSTS: fit()'s columns)

KV_GIB = 2.0


def timed_steps(engine: Engine) -> list[tuple[float, int, int, int]]:
    """Run the engine until its requests finish; per step (seconds, requests run, context tokens
    they attend to, prompt tokens prefilled), from the scheduler's own output."""
    scheduler = engine._core.engine_core.engine_core.scheduler
    seen: list = []
    schedule = scheduler.schedule

    def recorded(*args, **kwargs):
        out = schedule(*args, **kwargs)
        requests = {r.request_id: r for r in scheduler.running}
        context = prefilled = 0
        for request_id, tokens in out.num_scheduled_tokens.items():
            request = requests[request_id]
            # schedule() has already counted this step's tokens as computed
            before = request.num_computed_tokens - tokens
            context += request.num_computed_tokens
            prefilled += max(0, min(request.num_prompt_tokens - before, tokens))
        seen.append((len(out.num_scheduled_tokens), context, prefilled))
        return out

    scheduler.schedule = recorded
    steps = []
    try:
        while engine.has_unfinished():
            started = time.perf_counter()
            engine.step()
            elapsed = time.perf_counter() - started
            if seen and seen[-1][0]:
                steps.append((elapsed, *seen[-1]))
            seen.clear()
    finally:
        scheduler.schedule = schedule
    return steps


def measure(engine: Engine, vocab: int, batches: list[int], lengths: list[int], new_tokens: int, seed: int) -> list:
    rng = random.Random(seed)
    steps = []
    cells = [(n, length) for length in lengths for n in batches]
    for number, (n, length) in enumerate(tqdm(cells, desc="batch x prompt length")):
        for i in range(n):
            prompt = [rng.randrange(16, vocab) for _ in range(length)]
            engine.add_request(f"c{number}-{i}", prompt, new_tokens, 1.0, 1.0, [])
        steps += [(n, length, *step) for step in timed_steps(engine)]
    return steps


def fit(steps: list) -> dict[str, float]:
    """Least squares on the relative error: steps range from ~2 ms to ~70 ms, and an absolute fit
    leaves the small batches' steps twice as long as measured."""
    x = np.array([[1.0, seqs, context, prefilled] for *_, _, seqs, context, prefilled in steps])
    y = np.array([elapsed for _, _, elapsed, *_ in steps])
    coefficients, *_ = np.linalg.lstsq(x / y[:, None], np.ones_like(y), rcond=None)
    return dict(zip(ENGINE_COSTS, (float(c) for c in coefficients)))


def pool_rows(trace: dict) -> list[tuple[str, str, float, list[float]]]:
    """Per engine of each run the real pool measured without a preemption (bench/rollout_bench.py
    --trace-out): (workload, policy, seconds it stepped, [steps, request-steps, context tokens
    attended, tokens prefilled]), the sums the engine model's terms multiply. Request-steps are
    the tokens generated (one per running request a step); a turn of g tokens from a context of
    c attends to g x c + g (g - 1) / 2; what is prefilled is each turn's new tokens (the tool's
    answer: the rest is in the prefix cache), and of a prompt what no earlier rollout on its
    engine holds: its group's whole blocks, else the common prefix's (as --replay shares them)."""
    rows = []
    for workload in trace["workloads"]:
        sharing = PromptSharing(workload["group_size"], workload["block_size"], workload["common_prefix_tokens"])
        for run in workload["runs"]:
            if run["preemptions"]:
                continue  # what it recomputed is not in the traces
            sums = [[float(engine["steps"]), 0.0, 0.0, 0.0] for engine in run["engine_steps"]]
            groups_on: list[set[int]] = [set() for _ in sums]  # the groups each engine has prefilled
            for index, (prompt, turns, tools, _, engine) in enumerate(run["rollouts"]):
                group = index // sharing.group_size
                if group in groups_on[engine]:
                    cached = sharing.whole_blocks(prompt)
                else:
                    cached = sharing.whole_blocks(min(prompt, sharing.common_tokens)) if groups_on[engine] else 0
                groups_on[engine].add(group)
                context, added = 0, [prompt - cached] + [tokens for tokens, _ in tools]
                context += cached
                for generated, new in zip(turns, added):
                    context += new
                    row = sums[engine]
                    row[1] += generated
                    row[2] += generated * context + generated * (generated - 1) / 2
                    row[3] += new
                    context += generated
            for engine, row in zip(run["engine_steps"], sums):
                rows.append((workload["label"], run["policy"], engine["busy_s"], row))
    return rows


def fit_pool(rows: list, alone: dict[str, float]) -> dict[str, float]:
    """The step's fixed and per-request costs fitted on the pool (least squares on the relative
    error of each engine's stepped seconds in a run), its attention and prefill costs those of
    the engine alone (`alone`): a few dozen runs' sums cannot tell the four terms apart (a free
    fit gave negative ones), and what sharing the cores adds is per step and per request (the
    GIL, Ray's calls, vLLM's bookkeeping), not per token attended or prefilled."""
    x = np.array([row[:2] for *_, row in rows])
    y = np.array([busy for _, _, busy, _ in rows])
    fixed = np.array(
        [alone["step_per_context_token_s"] * row[2] + alone["prefill_per_token_s"] * row[3] for *_, row in rows]
    )
    coefficients, *_ = np.linalg.lstsq(x / y[:, None], 1 - fixed / y, rcond=None)
    return {
        "step_base_s": float(coefficients[0]),
        "step_per_seq_s": float(coefficients[1]),
        "step_per_context_token_s": alone["step_per_context_token_s"],
        "prefill_per_token_s": alone["prefill_per_token_s"],
    }


def fit_pool_uniform(rows: list, alone: dict[str, float]) -> dict[str, float]:
    """Every term of the engine alone times one factor, fitted like fit_pool: the cores' sharing
    slowing the whole step alike. One term where fit_pool has two, and the prefill that a
    preempted rollout recomputes (in runs the fit cannot see) scales with the rest."""
    share = np.array([predicted(alone, *row[1:], steps=row[0]) / busy for _, _, busy, row in rows])
    factor = float(share.sum() / (share @ share))
    return {term: alone[term] * factor for term in ENGINE_COSTS}


POOL_FITS = {"terms": fit_pool, "uniform": fit_pool_uniform}


def calibrate_on_pool(trace_path: Path, alone_path: Path, out: Path, how: str) -> None:
    rows = pool_rows(json.loads(trace_path.read_text()))
    alone = json.loads(alone_path.read_text())
    cost = POOL_FITS[how](rows, alone)
    print("alone: " + ", ".join(f"{term} {alone[term]:.3g}" for term in ENGINE_COSTS))
    print(f"{len(rows)} engine runs without a preemption")
    print("fit: " + ", ".join(f"{term} {value:.3g}" for term, value in cost.items()))
    print(f"{'workload':<28} {'policy':<11} {'runs':>4} {'stepped s':>9} {'fit s':>7} {'error':>7}")
    for label, policy in dict.fromkeys((label, policy) for label, policy, *_ in rows):
        cell = [(busy, row) for lab, pol, busy, row in rows if (lab, pol) == (label, policy)]
        real = sum(busy for busy, _ in cell)
        fitted = sum(predicted(cost, *row[1:], steps=row[0]) for _, row in cell)
        print(f"{label[:28]:<28} {policy:<11} {len(cell):>4} {real:>9.2f} {fitted:>7.2f} {fitted / real - 1:>+7.1%}")
    record = {"trace": str(trace_path), "alone": str(alone_path), "pool_fit": how, "engine_runs": len(rows)}
    write(out, record | cost)


def write(out: Path, record: dict) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    temporary = out.with_suffix(".tmp")
    temporary.write_text(json.dumps(record, indent=2))
    temporary.replace(out)
    print(f"written to {out}")


def predicted(cost: dict[str, float], seqs: float, context: float, prefilled: float, steps: float = 1) -> float:
    return sum(cost[term] * x for term, x in zip(ENGINE_COSTS, (steps, seqs, context, prefilled)))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    which = parser.add_mutually_exclusive_group(required=True)
    which.add_argument("--model", type=Path, help="time an engine of this model alone")
    which.add_argument("--pool", type=Path, help="fit on the real pool's runs instead (rollout_bench --trace-out)")
    parser.add_argument("--alone", type=Path, help="--pool: the engine alone's fit, for its per-token terms")
    parser.add_argument(
        "--pool-fit",
        choices=sorted(POOL_FITS),
        default="uniform",
        help="--pool: scale all four of the engine alone's terms alike, or refit the fixed and per-request ones",
    )
    parser.add_argument("--config", type=Path, default=default_config_path())
    parser.add_argument("--batches", default="1,2,4,8,16,32,64,128")
    parser.add_argument("--lengths", default="64,256,512")
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=2, help="passes over the grid; the first is untimed warm-up")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    if args.pool:
        if not args.alone:
            parser.error("--pool needs --alone (this script's --out for an engine of the same model alone)")
        calibrate_on_pool(args.pool, args.alone, args.out, args.pool_fit)
        return
    configure_cpu_runtime()
    cfg = load_config(args.config, {"engines.kv_cache_gib": KV_GIB})
    batches = [int(n) for n in args.batches.split(",")]
    lengths = [int(n) for n in args.lengths.split(",")]
    vocab = json.loads((args.model / "config.json").read_text())["vocab_size"]
    with Engine(args.model, cfg.engines.model_copy(update={"threads": 1}), seed=0) as engine:
        lengths = [length for length in lengths if length + args.new_tokens <= cfg.engines.max_model_len]
        steps = []
        for repeat in range(args.repeats):
            measured = measure(engine, vocab, batches, lengths, args.new_tokens, seed=repeat)
            if repeat:
                steps += measured
    cost = fit(steps)
    print(f"{len(steps)} engine steps")
    print("fit: " + ", ".join(f"{term} {value:.3g}" for term, value in cost.items()))
    print(f"{'batch':>5} {'prompt':>6} {'steps':>5} {'mean step ms':>12} {'fit ms':>7} {'error':>7}")
    for n in batches:
        for length in lengths:
            cell = [s for s in steps if s[:2] == (n, length)]
            if not cell:
                continue
            real = statistics.fmean(s[2] for s in cell)
            fitted = statistics.fmean(predicted(cost, *s[3:]) for s in cell)
            error = fitted / real - 1
            print(f"{n:>5} {length:>6} {len(cell):>5} {real * 1e3:>12.2f} {fitted * 1e3:>7.2f} {error:>+7.1%}")
    prefills = [s for s in steps if s[-1]]
    real, fitted = sum(s[2] for s in prefills), sum(predicted(cost, *s[3:]) for s in prefills)
    print(f"steps that prefilled ({len(prefills)}): {real:.2f} s measured, {fitted:.2f} s fitted")
    # The steps too, (batch, prompt, s, requests, context, prefilled), to fit another model from.
    write(args.out, {"model": str(args.model), "engine_steps": len(steps), **cost, "steps": steps})


if __name__ == "__main__":
    main()
