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
    LUCKY_SHARE,
    RECOVERED_SHARE,
    STEP_METRICS,
    WINDOW,
    RunResult,
    first_stage_window,
    format_cell,
    format_gain,
    mean_std,
    plot_curves,
    run_rows,
)


def _reduction(base: float, treat: float) -> float:
    return (base - treat) / base if base and not math.isnan(base) else math.nan


def compare(results: list[RunResult], baseline: str = "off", treatment: str = "paper") -> dict:
    """The report's numbers. Per mode, mean and std over seeds of: held-out pass@1 after SFT and
    after the last RL stage and the gain; the tool-error share among kept positives and among all
    drawn positives, the drawn ones split into recovered and lucky, response length and turns,
    each first averaged over a run's RL steps that had a positive; the drawn share over the first
    stage's first and last WINDOW steps (Fig. 4's two readings: what RoC has to act on, and what it
    taught). Then the treatment's relative reductions against the baseline
    (same seeds): of the kept share (selection), of the means and per seed, and of the drawn
    share at the end of stage 1 (learning)."""
    modes: dict[str, dict] = {}
    for mode in dict.fromkeys(r.mode for r in results):
        runs = [r for r in results if r.mode == mode]
        final = [list(r.pass_at_1.values())[-1] for r in runs]
        sft = [r.pass_at_1.get("sft", math.nan) for r in runs]
        share = [mean_std(r.steps.get("roc/kept_pos_tool_error_share", []))[0] for r in runs]

        def over_steps(metric: str) -> tuple[float, float, int]:
            return mean_std([mean_std(r.steps.get(metric, []))[0] for r in runs])  # noqa: B023

        modes[mode] = {
            "seeds": [r.seed for r in runs],
            "sft": mean_std(sft),
            "final": mean_std(final),
            "gain": mean_std([f - s for f, s in zip(final, sft)]),
            "error_share": mean_std(share),
            "error_share_by_seed": share,
            "drawn_error_share": over_steps(DRAWN_SHARE),
            "drawn_first": mean_std([first_stage_window(r, DRAWN_SHARE, first=True) for r in runs]),
            "drawn_end": mean_std([first_stage_window(r, DRAWN_SHARE, first=False) for r in runs]),
            "recovered": over_steps(RECOVERED_SHARE),
            "lucky": over_steps(LUCKY_SHARE),
            "length": over_steps("response_length_mean"),
            "turns": over_steps("turns_mean"),
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
        out["drawn_end_reduction"] = _reduction(base["drawn_end"][0], treat["drawn_end"][0])
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


def _percent(stats: tuple[float, float, int]) -> str:
    return format_cell(stats, percent=True)


# The per-step table's columns after the drawn share: (metric, header, format of its mean).
STEP_COLUMNS = (
    ("roc/kept_pos_tool_error_share", "kept", "{:.1%}"),
    (RECOVERED_SHARE, "recovered", "{:.1%}"),
    (LUCKY_SHARE, "lucky", "{:.1%}"),
    ("response_length_mean", "length", "{:.1f}"),
    ("turns_mean", "turns", "{:.2f}"),
)


def step_rows(results: list[RunResult]) -> list[str]:
    """A Markdown table with a row per (RL step, mode), stages numbered from 1: the share of drawn
    positives with a failed call (mean ± std over seeds, Fig. 4's curve), then the means of the
    kept share, the recovered and lucky shares, length and turns. A cell without a value in any
    seed (no positive that step) reads n/a."""
    lines = [
        "| stage | step | roc mode | drawn | " + " | ".join(h for _, h, _ in STEP_COLUMNS) + " |",
        "|---" * (4 + len(STEP_COLUMNS)) + "|",
    ]
    modes = {mode: [r for r in results if r.mode == mode] for mode in dict.fromkeys(r.mode for r in results)}
    ends = next(iter(modes.values()))[0].stage_ends
    for stage, (start, end) in enumerate(zip([0, *ends], ends), start=1):
        for step in range(start, end):
            for mode, runs in modes.items():
                cells = [_percent(_at_step(runs, DRAWN_SHARE, step))]
                for metric, _, fmt in STEP_COLUMNS:
                    mean, _, n = _at_step(runs, metric, step)
                    cells.append(fmt.format(mean) if n else "n/a")
                lines.append(f"| {stage} | {step - start} | {mode} | {' | '.join(cells)} |")
    return lines


def _at_step(runs: list[RunResult], metric: str, step: int) -> tuple[float, float, int]:
    return mean_std([r.steps[metric][step] for r in runs if step < len(r.steps[metric])])


def write_report(results: list[RunResult], out_dir: Path, command: str) -> Path:
    """report.md (per mode: pass@1 after SFT and after RL and the gain; the tool-error shares of
    positives, kept and drawn, early and late in stage 1, recovered and lucky; length and turns;
    RoC's relative reductions; those shares, length and turns per RL step and mode; a row per run
    with its pass@1 per checkpoint and wall time) and curves.png (each step metric per mode, the
    seeds' spread shaded), under out_dir."""
    numbers = compare(results)
    plot = plot_curves(results, out_dir / "curves.png", STEP_METRICS, "roc")
    seeds = sorted({r.seed for r in results})
    lines = [
        "# RoC ablation",
        "",
        f"Command: `{command}`",
        "",
        f"Seeds {seeds}; mean ± std over seeds. Held-out pass@1 is avg@k at the config's eval settings.",
        "",
        "| roc mode | pass@1 after SFT | pass@1 after RL | gain (points) |",
        "|---|---|---|---|",
    ]
    for mode, m in numbers["modes"].items():
        lines.append(f"| {mode} | {format_cell(m['sft'])} | {format_cell(m['final'])} | {format_gain(m['gain'])} |")
    lines += [
        "",
        "Positive trajectories (reward > 0) with at least one failed tool call, in %: among those RoC kept for "
        "training, and among all the policy drew, over every RL step with a positive, then over stage 1's first "
        f"and last {WINDOW} steps; the drawn ones split into recovered (a later call succeeded) and lucky (the last "
        "call failed). Length in tokens and turns per rollout, all rollouts drawn.",
        "",
        "| roc mode | kept | drawn | drawn, first steps | drawn, end of stage 1 | recovered | lucky | length | turns |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for mode, m in numbers["modes"].items():
        shares = [m[k] for k in ("error_share", "drawn_error_share", "drawn_first", "drawn_end", "recovered", "lucky")]
        lines.append(
            f"| {mode} | {' | '.join(_percent(x) for x in shares)} | {m['length'][0]:.1f} | {m['turns'][0]:.2f} |"
        )
    if "relative_reduction" in numbers:
        reduction = numbers["relative_reduction"]
        by_seed = numbers["relative_reduction_by_seed"].values()
        per_seed = " / ".join("n/a" if math.isnan(r) else f"{100 * r:.0f}%" for r in by_seed)
        drawn = numbers["drawn_end_reduction"]
        lines += [
            "",
            "Tool-error share among kept positives, roc paper vs off (selection): "
            + (
                f"{100 * reduction:.0f}% lower (relative); per seed {per_seed}, "
                f"mean {format_cell(mean_std(list(by_seed)), True)}%."
                if not math.isnan(reduction)
                else "not measurable (a mode kept no positive trajectory, or off kept no erring one)."
            ),
            "Among all positives drawn at the end of stage 1, roc paper vs off (learning): "
            + (f"{100 * drawn:.0f}% lower (relative)." if not math.isnan(drawn) else "not measurable."),
        ]
    lines += [
        "",
        "Per RL step, mean over seeds: positives with a failed tool call among those drawn (± std), among those "
        "kept, and the drawn ones that recovered or were lucky; length in tokens and turns of all rollouts drawn.",
        "",
        *step_rows(results),
        "",
        *run_rows(results),
        "",
        f"![curves]({plot.name})",
        "",
    ]
    report = write_text("\n".join(lines), out_dir / "report.md")
    print("\n".join(lines))
    return report
