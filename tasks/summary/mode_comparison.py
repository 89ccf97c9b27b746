"""The RoC ablation: the same config run with `rl.roc.mode` paper / release / off over several
seeds, compared in one report (the paper's Fig. 4 in miniature).

The runs of one seed share everything before RL (curated data, base and SFT policies and their
evaluations: the RoC mode changes nothing there), so the later modes start from a copy of the
first one's run folder instead of training the same SFT policy again. `compare` is pure; the
rest writes the report (Markdown and PNG plots) from the runs tasks/summary/runs.py reads; a
seed's later modes start from a copy of its first run (tasks/store/run_folder.py).
"""

from __future__ import annotations

import json
import math
import shlex
from pathlib import Path

from tasks.store.tables import write_text
from tasks.summary.runs import (
    DRAWN_SHARE,
    STEP_METRICS,
    RunResult,
    format_cell,
    format_gain,
    mean_std,
    plot_curves,
    run_rows,
)


def _reduction(base: float, treat: float) -> float:
    return (base - treat) / base if base and not math.isnan(base) else math.nan


def compare(results: list[RunResult], baseline: str = "off", treatment: str = "paper") -> dict:
    """The report's numbers. Per mode: held-out pass@1 after SFT and after the last RL stage and
    the gain (mean and std over seeds), and the tool-error shares among kept and among all drawn
    positives, each averaged over the RL steps that had a positive (then mean and std over
    seeds). Then the treatment's relative reduction of the kept share against the baseline (same
    seeds, same steps): of the means, and per seed."""
    modes: dict[str, dict] = {}
    for mode in dict.fromkeys(r.mode for r in results):
        runs = [r for r in results if r.mode == mode]
        final = [list(r.pass_at_1.values())[-1] for r in runs]
        sft = [r.pass_at_1.get("sft", math.nan) for r in runs]
        share = [mean_std(r.steps.get("roc/kept_pos_tool_error_share", []))[0] for r in runs]
        drawn = [mean_std(r.steps.get(DRAWN_SHARE, []))[0] for r in runs]
        modes[mode] = {
            "seeds": [r.seed for r in runs],
            "sft": mean_std(sft),
            "final": mean_std(final),
            "gain": mean_std([f - s for f, s in zip(final, sft)]),
            "error_share": mean_std(share),
            "error_share_by_seed": share,
            "drawn_error_share": mean_std(drawn),
        }
    out = {"modes": modes}
    if baseline in modes and treatment in modes:
        base, treat = modes[baseline], modes[treatment]
        out["relative_reduction"] = _reduction(base["error_share"][0], treat["error_share"][0])
        by_seed = dict(zip(base["seeds"], base["error_share_by_seed"]))
        out["relative_reduction_by_seed"] = {
            seed: _reduction(by_seed[seed], share)
            for seed, share in zip(treat["seeds"], treat["error_share_by_seed"])
            if seed in by_seed
        }
    return out


def ablation_command(
    config: str,
    seeds: int,
    modes: list[str],
    overrides: dict,
    name: str,
    sft_from: str | None = None,
    command: str = "ablate",
    arms_flag: str = "--modes",
) -> str:
    """The `rstar2 <command>` line (ablate, coldstart) that reproduces a comparison, for its report."""
    return shlex.join(
        [
            "rstar2",
            command,
            "--config",
            config,
            "--seeds",
            str(seeds),
            arms_flag,
            *modes,
            "--name",
            name,
            *(["--sft-from", sft_from] if sft_from else []),
            *(f"--set={k}={json.dumps(v)}" for k, v in overrides.items()),
        ]
    )


def write_report(results: list[RunResult], out_dir: Path, command: str) -> Path:
    """report.md (a table per mode: pass@1 after SFT and after RL, the gain, the tool-error
    share among kept positives; RoC's relative reduction; a row per run with its pass@1 per
    checkpoint and wall time) and curves.png, under out_dir."""
    numbers = compare(results)
    plot = plot_curves(results, out_dir / "curves.png", STEP_METRICS, "roc")
    seeds = sorted({r.seed for r in results})
    lines = [
        "# RoC ablation",
        "",
        f"Command: `{command}`",
        "",
        f"Seeds {seeds}; mean ± std over seeds. Held-out pass@1 is avg@k at the config's eval settings; the "
        "tool-error share is the fraction of positive trajectories with at least one failed tool call, among "
        "those RoC kept for training and among all the policy drew, averaged over the RL steps that had one.",
        "",
        "| roc mode | pass@1 after SFT | pass@1 after RL | gain (points) | tool-error share of kept positives (%) "
        "| of all positives drawn (%) |",
        "|---|---|---|---|---|---|",
    ]
    for mode, m in numbers["modes"].items():
        lines.append(
            f"| {mode} | {format_cell(m['sft'])} | {format_cell(m['final'])} | {format_gain(m['gain'])} | "
            f"{format_cell(m['error_share'], percent=True)} | {format_cell(m['drawn_error_share'], percent=True)} |"
        )
    if "relative_reduction" in numbers:
        reduction = numbers["relative_reduction"]
        by_seed = numbers["relative_reduction_by_seed"].values()
        per_seed = " / ".join("n/a" if math.isnan(r) else f"{100 * r:.0f}%" for r in by_seed)
        lines += [
            "",
            "Tool-error share among kept positives, roc paper vs off: "
            + (
                f"{100 * reduction:.0f}% lower (relative); per seed {per_seed}, "
                f"mean {format_cell(mean_std(list(by_seed)), True)}%."
                if not math.isnan(reduction)
                else "not measurable (a mode kept no positive trajectory, or off kept no erring one)."
            ),
        ]
    lines += ["", *run_rows(results), "", f"![curves]({plot.name})", ""]
    report = write_text("\n".join(lines), out_dir / "report.md")
    print("\n".join(lines))
    return report
