"""Finished runs read back for the comparison reports (the RoC ablation's, the cold-start
experiment's and rl.async's): held-out pass@1 per checkpoint and the RL step metrics of a run, the statistics
over seeds, the per-run table and the curves."""

from __future__ import annotations

import json
import math
import statistics
from dataclasses import dataclass, field
from pathlib import Path

from tasks.records import ToolStatus
from tasks.store.tables import evaluation_rows, read_table, stage_steps, step_part

# The share of all positives the policy drew (kept or not) with a failed tool call: the policy's
# own habit, which the paper's Fig. 4 follows; the kept share adds RoC's selection on top. It
# splits into positives that recovered (a later call succeeded) and lucky ones (the last call
# failed and the answer was right anyway).
DRAWN_SHARE = "drawn_pos_tool_error_share"
RECOVERED_SHARE = "drawn_pos_recovered_share"
LUCKY_SHARE = "drawn_pos_lucky_share"
# What the report plots per RL step: (metric of the steps table or a drawn share, axis title).
STEP_METRICS = {
    "reward_mean": "reward (mean)",
    "roc/kept_pos_tool_error_share": "tool-error share, kept positives",
    DRAWN_SHARE: "tool-error share, all positives drawn",
    LUCKY_SHARE: "lucky share, all positives drawn",
    "response_length_mean": "response length (tokens)",
    "turns_mean": "turns per rollout",
}
# Also read per RL step, for the cold-start and rl.async reports (tasks/summary/cold_start.py,
# async_comparison.py).
RUN_METRICS = {
    **STEP_METRICS,
    RECOVERED_SHARE: "recovered share, all positives drawn",
    "tool_error_rate": "tool-error rate (of calls)",
    "time_step_s": "step time (s)",
    "staleness/mean": "staleness (policy versions)",
    "idle/trainer": "trainer idle fraction",
    "idle/engines": "engine idle fraction",
}


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


def positive_shares(rollouts: list[dict]) -> dict[str, float]:
    """Among the positive (reward > 0) rollouts: the share with a failed tool call, and the shares
    that recovered and that were lucky (their last call answered, not an outage, failed); NaNs
    without any positive."""
    positives = [r for r in rollouts if r["reward"] > 0]
    if not positives:
        return dict.fromkeys((DRAWN_SHARE, RECOVERED_SHARE, LUCKY_SHARE), math.nan)
    failed = [r for r in positives if r["tool_failures"] > 0]
    lucky = sum(
        ToolStatus([s for s in r["tool_statuses"] if s != ToolStatus.INTERNAL.value][-1]).is_failure for r in failed
    )
    return {
        DRAWN_SHARE: len(failed) / len(positives),
        RECOVERED_SHARE: (len(failed) - lucky) / len(positives),
        LUCKY_SHARE: lucky / len(positives),
    }


def paired_gain(before: list[dict], after: list[dict]) -> tuple[float, float]:
    """(gain, standard error) of pass@1 from one evaluation's rollouts to another's on the same
    problems (rows with problem_id and reward, k >= 2 samples each). The error is that of the
    evaluations' sampling alone, the policies held fixed: per problem the samples' variance over
    k, summed over problems, over their count squared. Whether a gain is the policy's or the
    draw's is then a question of how many errors it is."""
    by_problem = []
    for rows in (before, after):
        rewards: dict[str, list[float]] = {}
        for row in rows:
            rewards.setdefault(row["problem_id"], []).append(row["reward"])
        by_problem.append(rewards)
    if by_problem[0].keys() != by_problem[1].keys():
        raise ValueError(
            f"the evaluations cover different problems ({len(by_problem[0])} and {len(by_problem[1])}, "
            f"{len(by_problem[0].keys() ^ by_problem[1].keys())} in one only): a paired gain needs the same set"
        )
    if thin := [p for rewards in by_problem for p, r in rewards.items() if len(r) < 2]:
        raise ValueError(f"problem {thin[0]} has one sample in an evaluation: its variance needs k >= 2")
    problems = list(by_problem[0])
    gain = statistics.fmean(statistics.fmean(by_problem[1][p]) - statistics.fmean(by_problem[0][p]) for p in problems)
    variance = sum(statistics.variance(r[p]) / len(r[p]) for r in by_problem for p in problems)
    return gain, math.sqrt(variance) / len(problems)


def read_run(run_dir: Path, seed: int, mode: str, stage_names: list[str]) -> RunResult:
    """A finished run's held-out pass@1 per checkpoint and its RL step metrics, stage by stage."""
    pass_at_1 = {
        row["checkpoint"]: row["pass_at_1"] for row in evaluation_rows(run_dir) if row["benchmark"] == "heldout"
    }
    result = RunResult(seed, mode, run_dir.name, pass_at_1, {m: [] for m in RUN_METRICS})
    for stage in stage_names:
        for step, values in stage_steps(run_dir, stage).items():
            values.update(positive_shares(read_table(step_part(run_dir, "rollouts", stage, step))))
            for metric in RUN_METRICS:
                result.steps[metric].append(values.get(metric, math.nan))
        result.stage_ends.append(len(result.steps["reward_mean"]))
    summary = run_dir / "summary.json"
    if summary.exists():
        result.wall_s = json.loads(summary.read_text())["wall_s"]
    return result


# RL steps averaged for "early" and "late" in the first stage (the later stages draw other problems).
WINDOW = 3


def first_stage(run: RunResult, metric: str) -> list[float]:
    """The metric per RL step of the run's first stage."""
    values = run.steps.get(metric, [])
    return values[: run.stage_ends[0]] if run.stage_ends else values


def first_stage_window(run: RunResult, metric: str, first: bool) -> float:
    """The metric's mean over the first stage's first or last WINDOW steps (NaN steps left out)."""
    values = first_stage(run, metric)
    return mean_std(values[:WINDOW] if first else values[-WINDOW:])[0]


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
