"""The cold-start experiment: the same RL stages from a non-reasoning SFT policy and from a
reasoning one (`sft.mode`), over several seeds, in one report.

The paper's claim: RL from a non-reasoning SFT (tool-call format, instruction following, chat)
draws the reasoning out of the base model, where a reasoning SFT would fix patterns that RL then
has to undo. The runs of one seed share the base model (`sft.mode` does not change it), so later
arms start from a copy of the first one's run folder after the base model. `summarize` and
`half_final_step` are pure; `write_report` writes Markdown and a PNG of the curves.
"""

from __future__ import annotations

import math
import statistics
from pathlib import Path

from tasks.store.tables import write_text
from tasks.summary.runs import (
    WINDOW,
    RunResult,
    first_stage,
    first_stage_window,
    format_cell,
    format_gain,
    mean_std,
    plot_curves,
    run_rows,
)

CURVES = {
    "reward_mean": "reward (mean)",
    "response_length_mean": "response length (tokens)",
    "turns_mean": "turns per rollout",
    "tool_error_rate": "tool-error rate (of calls)",
}


def half_final_step(rewards: list[float], window: int = WINDOW) -> float:
    """The first step (1-based) whose mean reward reaches half the final value, the mean of the
    last `window` steps: how early the reward curve rises. NaN without a positive final value."""
    finite = [r for r in rewards if not math.isnan(r)]
    final = statistics.fmean(finite[-window:]) if finite else math.nan
    if not final > 0:
        return math.nan
    half = final / 2 - 1e-12  # the mean of equal rewards can land a rounding error above them
    return next(step for step, r in enumerate(rewards, start=1) if r >= half)


def summarize(results: list[RunResult]) -> dict[str, dict]:
    """Per arm (mean, std, n over seeds): held-out pass@1 after SFT and after the last RL stage,
    the gain; mean response length and turns per rollout over the first WINDOW steps of RL and
    the last WINDOW steps of its first stage (the later stages draw other problems); the
    tool-error rate over all RL steps; and the step at which the first stage's reward first
    reaches half its final value."""
    arms: dict[str, dict] = {}
    for arm in dict.fromkeys(r.mode for r in results):
        runs = [r for r in results if r.mode == arm]
        sft = [r.pass_at_1.get("sft", math.nan) for r in runs]
        final = [list(r.pass_at_1.values())[-1] for r in runs]
        arms[arm] = {
            "seeds": [r.seed for r in runs],
            "sft": mean_std(sft),
            "final": mean_std(final),
            "gain": mean_std([f - s for f, s in zip(final, sft)]),
            "length_first": mean_std([first_stage_window(r, "response_length_mean", first=True) for r in runs]),
            "length_end": mean_std([first_stage_window(r, "response_length_mean", first=False) for r in runs]),
            "turns_first": mean_std([first_stage_window(r, "turns_mean", first=True) for r in runs]),
            "turns_end": mean_std([first_stage_window(r, "turns_mean", first=False) for r in runs]),
            "tool_error_rate": mean_std([mean_std(r.steps["tool_error_rate"])[0] for r in runs]),
            "half_final_step": mean_std([half_final_step(first_stage(r, "reward_mean")) for r in runs]),
        }
    return arms


def _number(stats: tuple[float, float, int], digits: int = 1) -> str:
    mean, std, n = stats
    return "n/a" if n == 0 else f"{mean:.{digits}f} ± {std:.{digits}f}"


def write_report(results: list[RunResult], out_dir: Path, command: str) -> Path:
    """report.md (a row per arm, a row per run) and curves.png under out_dir."""
    arms = summarize(results)
    plot = plot_curves(results, out_dir / "curves.png", CURVES, "sft")
    seeds = sorted({r.seed for r in results})
    lines = [
        "# Cold start: non-reasoning vs reasoning SFT before the same RL",
        "",
        f"Command: `{command}`",
        "",
        f"Seeds {seeds}; mean ± std over seeds. Held-out pass@1 is avg@k at the config's eval settings. "
        f"Length (tokens) and turns are per rollout, averaged over the first {WINDOW} RL steps and the last "
        f"{WINDOW} steps of the first RL stage; the tool-error rate is failed calls over calls, over all RL "
        "steps; half-reward step: the first step of the first stage whose mean reward reaches half of its "
        f"final value (the mean of its last {WINDOW} steps).",
        "",
        "| sft mode | pass@1 after SFT | pass@1 after RL | gain (points) | length first -> end "
        "| turns first -> end | tool-error rate (%) | half-reward step |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for arm, a in arms.items():
        lines.append(
            f"| {arm} | {format_cell(a['sft'])} | {format_cell(a['final'])} | {format_gain(a['gain'])} | "
            f"{_number(a['length_first'], 0)} -> {_number(a['length_end'], 0)} | "
            f"{_number(a['turns_first'], 2)} -> {_number(a['turns_end'], 2)} | "
            f"{format_cell(a['tool_error_rate'], percent=True)} | {_number(a['half_final_step'])} |"
        )
    lines += ["", *run_rows(results), "", f"![curves]({plot.name})", ""]
    report = write_text("\n".join(lines), out_dir / "report.md")
    print("\n".join(lines))
    return report
