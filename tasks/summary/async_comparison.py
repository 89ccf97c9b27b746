"""rl.async against on-policy training: the same RL stages from one SFT policy per seed, with
`rl.async.mode` off and one_step (or bounded), compared in one report.

What a user needs to switch it on: does the policy learn as much (held-out pass@1 after RL
within the spread of `off` over seeds), how stale were the rollouts it trained on, and how much
of each step the trainer and the engines sat idle. Wall times here come from runs that may
share the machine with others; bench/async_bench.py measures the speed-up alone.
"""

from __future__ import annotations

import math
from pathlib import Path

from tasks.store.tables import write_text
from tasks.summary.runs import RunResult, format_cell, format_gain, mean_std, plot_curves, run_rows

CURVES = {
    "reward_mean": "reward (mean)",
    "staleness/mean": "staleness (policy versions)",
    "tool_error_rate": "tool-error rate (of calls)",
}

AVERAGED = (*CURVES, "idle/trainer", "idle/engines", "time_step_s")  # over a run's steps, then seeds


def summarize(results: list[RunResult], baseline: str = "off") -> dict[str, dict]:
    """Per arm (mean, std, n over seeds): held-out pass@1 after SFT and after the last RL stage,
    the gain, the step-averaged staleness and idle fractions; and whether the arm's mean pass@1
    after RL lies within the baseline's seeds' range (lowest to highest)."""
    finals = {r.mode: [] for r in results}
    for r in results:
        finals[r.mode].append(list(r.pass_at_1.values())[-1])
    base = [v for v in finals.get(baseline, []) if not math.isnan(v)]
    arms = {}
    for arm, final in finals.items():
        runs = [r for r in results if r.mode == arm]
        sft = [r.pass_at_1.get("sft", math.nan) for r in runs]
        per_run = {m: mean_std([mean_std(r.steps.get(m, []))[0] for r in runs]) for m in AVERAGED}
        mean = mean_std(final)[0]
        arms[arm] = {
            "seeds": [r.seed for r in runs],
            "sft": mean_std(sft),
            "final": mean_std(final),
            "gain": mean_std([f - s for f, s in zip(final, sft)]),
            "staleness": per_run["staleness/mean"],
            "idle_trainer": per_run["idle/trainer"],
            "idle_engines": per_run["idle/engines"],
            "step_s": per_run["time_step_s"],
            "within_baseline": bool(base) and min(base) <= mean <= max(base),
        }
    return arms


def write_report(results: list[RunResult], out_dir: Path, command: str) -> Path:
    """report.md (a row per arm, a row per run) and curves.png under out_dir."""
    arms = summarize(results)
    plot = plot_curves(results, out_dir / "curves.png", CURVES, "rl.async")
    base = [list(r.pass_at_1.values())[-1] for r in results if r.mode == "off"]
    lines = [
        "# rl.async: training on rollouts drawn during the previous update, against on-policy",
        "",
        f"Command: `{command}`",
        "",
        f"Seeds {sorted({r.seed for r in results})}; mean ± std over seeds, each arm of a seed from the same "
        "SFT policy. Held-out pass@1 is avg@k at the config's eval settings. Staleness: policy versions "
        "between the weights that drew a rollout and the update that trained on it, averaged over steps. "
        "Idle fractions: the share of each step's wall time the trainer (update and checkpoint) and the "
        "engines did not work. Step times are from runs that may have shared the machine: "
        "bench/async_bench.py measures speed alone.",
        "",
        "| rl.async | pass@1 after SFT | pass@1 after RL | gain (points) | staleness | trainer idle "
        "| engines idle | step (s) | after RL within off's range |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for arm, a in arms.items():
        lines.append(
            f"| {arm} | {format_cell(a['sft'])} | {format_cell(a['final'])} | {format_gain(a['gain'])} | "
            f"{format_cell(a['staleness'])} | {format_cell(a['idle_trainer'])} | {format_cell(a['idle_engines'])} | "
            f"{format_cell(a['step_s'])} | {'yes' if a['within_baseline'] else 'no'} |"
        )
    if base:
        lines += ["", f"off's range after RL over seeds: {min(base):.3f} to {max(base):.3f}."]
    lines += ["", *run_rows(results), "", f"![curves]({plot.name})", ""]
    report = write_text("\n".join(lines), out_dir / "report.md")
    print("\n".join(lines))
    return report
