"""The RoC ablation: the same config run with `rl.roc.mode` paper / release / off over several
seeds, compared in one report (the paper's Fig. 4 in miniature).

The runs of one seed share everything before RL (curated data, base and SFT policies and their
evaluations: the RoC mode changes nothing there), so the later modes start from a copy of the
first one's run folder instead of training the same SFT policy again. `compare` is pure; the
rest reads the runs' tables and writes the report (Markdown and PNG plots). Reading runs, copying
a run up to a policy, the per-run table and the curves serve the cold-start report too
(tasks/summary/cold_start.py).
"""

from __future__ import annotations

import json
import math
import shlex
import shutil
import statistics
from dataclasses import dataclass, field
from pathlib import Path

from tasks.config import RunConfig
from tasks.store.tables import evaluation_rows, read_table, stage_steps, step_part, write_text

# The share of all positives the policy drew (kept or not) with a failed tool call: the policy's
# own habit, which the paper's Fig. 4 follows; the kept share adds RoC's selection on top.
DRAWN_SHARE = "drawn_pos_tool_error_share"
# What the report plots per RL step: (metric of the steps table or DRAWN_SHARE, axis title).
STEP_METRICS = {
    "reward_mean": "reward (mean)",
    "roc/kept_pos_tool_error_share": "tool-error share, kept positives",
    DRAWN_SHARE: "tool-error share, all positives drawn",
    "response_length_mean": "response length (tokens)",
}
# Also read per RL step, for the cold-start report (tasks/summary/cold_start.py).
RUN_METRICS = {**STEP_METRICS, "turns_mean": "turns per rollout", "tool_error_rate": "tool-error rate (of calls)"}
# What a run starting from another one's policy copies: its records of the stages up to it.
SHARED_STAGES = {"base": ("curate", "base", "eval-base"), "sft": ("curate", "base", "sft", "eval-base", "eval-sft")}
# Config fields runs sharing those stages may differ in (the rest trained the shared policies).
MAY_DIFFER = {"base": ("rl", "sft.mode"), "sft": ("rl",)}


@dataclass
class RunResult:
    """One (seed, mode) run: held-out pass@1 per checkpoint, and step metrics along all RL steps."""

    seed: int
    mode: str
    run_id: str
    pass_at_1: dict[str, float]  # checkpoint -> held-out pass@1, in evaluation order
    steps: dict[str, list[float]] = field(default_factory=dict)  # metric -> value per RL step (NaN: none)
    stage_ends: list[int] = field(default_factory=list)  # cumulative RL steps after each stage
    wall_s: float = math.nan  # the run's own stages (a later mode's run copies the SFT policy)


def mean_std(values: list[float]) -> tuple[float, float, int]:
    """(mean, sample std, n) of the finite values; NaNs when there are none."""
    finite = [v for v in values if not math.isnan(v)]
    if not finite:
        return math.nan, math.nan, 0
    return statistics.fmean(finite), statistics.stdev(finite) if len(finite) > 1 else 0.0, len(finite)


def positive_error_share(rollouts: list[dict]) -> float:
    """Fraction of the positive (reward > 0) rollouts with a failed tool call; NaN without any."""
    positives = [r for r in rollouts if r["reward"] > 0]
    return statistics.fmean(r["tool_failures"] > 0 for r in positives) if positives else math.nan


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


def _without(tree: dict, paths: tuple[str, ...]) -> dict:
    """A copy of a config tree without the dotted `paths`."""
    tree = json.loads(json.dumps(tree))
    for path in paths:
        *parents, leaf = path.split(".")
        node = tree
        for key in parents:
            node = node.get(key, {})
        node.pop(leaf, None)
    return tree


def start_from_run(source: Path, target: Path, cfg: RunConfig, upto: str = "sft") -> None:
    """Make run folder `target` continue where run `source` stands after its `upto` policy
    (`base` or `sft`): its curated data, policies up to that one, their evaluation rows and
    finished records (paths rewritten). Does nothing when `target` already has a config (a
    comparison being resumed). `cfg` is the target's config: it may differ from the source's only
    in the fields of MAY_DIFFER[upto]."""
    if (target / "config.json").exists():
        return
    allowed = MAY_DIFFER[upto]
    theirs = _without(json.loads((source / "config.json").read_text()), allowed)
    mine = _without(json.loads(cfg.model_dump_json()), allowed)
    if differ := sorted(k for k in theirs.keys() | mine.keys() if theirs.get(k) != mine.get(k)):
        raise ValueError(
            f"run {source.name} cannot seed run {target.name}: their configs differ in {differ}, "
            f"and only {', '.join(allowed)} may (the runs share everything up to the {upto} policy)"
        )
    checkpoints = ("base", "sft")[: ("base", "sft").index(upto) + 1]
    staging = target.with_name(f".{target.name}.partial")
    shutil.rmtree(staging, ignore_errors=True)
    for folder in ("data", *(f"models/{c}" for c in checkpoints)):
        shutil.copytree(source / folder, staging / folder)
    for checkpoint in checkpoints:
        for part in (source / "evaluations").glob(f"checkpoint={checkpoint}/*"):
            shutil.copytree(part, staging / part.relative_to(source))
        for part in (source / "rollouts").glob(f"stage=eval-{checkpoint}*"):
            shutil.copytree(part, staging / part.relative_to(source))
    (staging / "state").mkdir()
    for name in SHARED_STAGES[upto]:
        record = source / "state" / f"{name}.json"
        if name == "eval-base" and not record.exists():  # eval.base: false
            continue
        (staging / "state" / record.name).write_text(record.read_text().replace(str(source), str(target)))
    shutil.rmtree(target, ignore_errors=True)
    staging.rename(target)


def sft_run_of(runs_dir: Path, ablation: str, seed: int) -> Path:
    """The run of ablation `ablation` (any mode) that trained seed `seed`'s SFT policy."""
    for run_dir in sorted(runs_dir.glob(f"{ablation}-s{seed}-*")):
        if (run_dir / "state" / "sft.json").exists():
            return run_dir
    raise ValueError(
        f"no run {ablation}-s{seed}-<mode> under {runs_dir} has finished SFT: run "
        f"`rstar2 ablate --name {ablation}` with {seed + 1} seed(s) first"
    )


def read_run(run_dir: Path, seed: int, mode: str, stage_names: list[str]) -> RunResult:
    """A finished run's held-out pass@1 per checkpoint and its RL step metrics, stage by stage."""
    pass_at_1 = {
        row["checkpoint"]: row["pass_at_1"] for row in evaluation_rows(run_dir) if row["benchmark"] == "heldout"
    }
    result = RunResult(seed, mode, run_dir.name, pass_at_1, {m: [] for m in RUN_METRICS})
    for stage in stage_names:
        for step, values in stage_steps(run_dir, stage).items():
            values[DRAWN_SHARE] = positive_error_share(read_table(step_part(run_dir, "rollouts", stage, step)))
            for metric in RUN_METRICS:
                result.steps[metric].append(values.get(metric, math.nan))
        result.stage_ends.append(len(result.steps["reward_mean"]))
    summary = run_dir / "summary.json"
    if summary.exists():
        result.wall_s = json.loads(summary.read_text())["wall_s"]
    return result


def format_cell(stats: tuple[float, float, int], percent: bool = False) -> str:
    mean, std, n = stats
    if n == 0:
        return "n/a"
    scale = 100.0 if percent else 1.0
    return f"{mean * scale:.1f} ± {std * scale:.1f}" if percent else f"{mean:.3f} ± {std:.3f}"


def format_gain(stats: tuple[float, float, int]) -> str:
    """A pass@1 difference in points, signed."""
    mean, std, n = stats
    return f"{100 * mean:+.1f} ± {100 * std:.1f}" if n else "n/a"


def plot_curves(results: list[RunResult], path: Path, metrics: dict[str, str], label: str) -> Path:
    """One panel per step metric and one of held-out pass@1, a line per mode (`label: mode`):
    the mean over seeds, shaded between the lowest and highest seed."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [*metrics.items(), ("pass_at_1", "held-out pass@1 (avg@k)")]
    fig, axes = plt.subplots(1, len(panels), figsize=(4.2 * len(panels), 3.4))
    for ax, (metric, title) in zip(axes, panels):
        for mode in dict.fromkeys(r.mode for r in results):
            runs = [r for r in results if r.mode == mode]
            if metric == "pass_at_1":  # one point per checkpoint: SFT at step 0, each stage at its end
                xs = [0, *runs[0].stage_ends]
                series = [list(r.pass_at_1.values())[-len(xs) :] for r in runs]
            else:
                xs = list(range(1, len(runs[0].steps[metric]) + 1))
                series = [r.steps[metric] for r in runs]
            columns = [mean_std([s[i] for s in series if i < len(s)]) for i in range(len(xs))]
            means = [c[0] for c in columns]
            lows = [
                min((s[i] for s in series if i < len(s) and not math.isnan(s[i])), default=math.nan)
                for i in range(len(xs))
            ]
            highs = [
                max((s[i] for s in series if i < len(s) and not math.isnan(s[i])), default=math.nan)
                for i in range(len(xs))
            ]
            (line,) = ax.plot(xs, means, marker="o", markersize=3, label=f"{label}: {mode}")
            ax.fill_between(xs, lows, highs, color=line.get_color(), alpha=0.15)
        ax.set_title(title, fontsize=10)
        ax.set_xlabel("RL step")
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def run_rows(results: list[RunResult]) -> list[str]:
    """A Markdown table with a row per run: its pass@1 per checkpoint and wall time."""
    return ["| run | held-out pass@1 by checkpoint | wall (s) |", "|---|---|---|"] + [
        f"| `{r.run_id}` | "
        + " -> ".join(f"{c} {v:.3f}" for c, v in r.pass_at_1.items())
        + (" | n/a |" if math.isnan(r.wall_s) else f" | {r.wall_s:.0f} |")
        for r in results
    ]


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
