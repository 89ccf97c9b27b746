"""What a run reports about itself: the evaluation of a checkpoint on one benchmark, the wall time
of each stage over all attempts, and the report card (a table per stage and one per evaluation)."""

from __future__ import annotations

import json
import time
from pathlib import Path

from rich.console import Console
from rich.table import Table

from tasks.records import Rollouts
from tasks.rollout.metrics import rollout_metrics
from tasks.store.tables import EVALUATIONS, evaluation_rows, write_json

SUMMARY_COLUMNS = ["stage", "steps", "pass@1 before", "pass@1 after", "tool-call rate", "tool-error rate", "wall s"]


def evaluation(run_id: str, label: str, benchmark: str, rollouts: Rollouts, k: int) -> tuple[dict, dict, list[dict]]:
    """(metrics, the EVALUATIONS row, a few whole trajectories to read beside the numbers: the first
    sample of up to 8 problems) of checkpoint `label` on one benchmark; pass@1 is avg@k."""
    metrics = rollout_metrics(rollouts.trajectories, rollouts.rewards)
    metrics["pass_at_1"] = metrics["reward_mean"]  # mean over problems and their k samples
    row = {
        "run_id": run_id,
        "checkpoint": label,
        "benchmark": benchmark,
        "problems": len(rollouts.problems),
        "k": k,
        **{c: metrics[c] for c in EVALUATIONS.names if c in metrics},
    }
    samples = [
        {"problem_id": t.problem_id, "reward": r, "stop_reason": t.stop_reason, "response": t.response}
        for t, r in zip(rollouts.trajectories, rollouts.rewards)
        if t.sample == 0
    ][:8]
    return metrics, row, samples


class Stopwatch:
    """Wall time per stage for the summary table, summed over the attempts of a run (kept in
    run_dir/state/wall.json): a resumed run's table shows what each stage cost, not the seconds
    its second attempt spent skipping it. A stage's time counts from the end of the one before."""

    def __init__(self, run_dir: Path):
        self.path = run_dir / "state" / "wall.json"
        self.spent: dict[str, float] = json.loads(self.path.read_text()) if self.path.exists() else {}
        self.last = time.perf_counter()

    def lap(self, stage: str) -> float:
        """The stage's seconds over all attempts, this one's up to now included."""
        now = time.perf_counter()
        self.spent[stage] = self.spent.get(stage, 0.0) + now - self.last
        self.last = now
        write_json(self.spent, self.path)
        return self.spent[stage]

    def total(self) -> float:
        return sum(self.spent.values())


def stage_row(stage: str, steps: int | None, before: dict | None, after: dict | None, clock: Stopwatch) -> dict:
    wall_s = clock.lap(stage)
    return {
        "stage": stage,
        "steps": steps,
        "pass@1 before": before["pass_at_1"] if before else None,
        "pass@1 after": after["pass_at_1"] if after else None,
        "tool-call rate": after["tool_call_rate"] if after else None,
        "tool-error rate": after["tool_error_rate"] if after else None,
        "wall s": round(wall_s, 1),
    }


# What a stage's summary shows per step, of the metrics in the steps table.
STAGE_SUMMARY_COLUMNS = (
    "reward_mean",
    "kept",
    "tool_call_rate",
    "tool_error_rate",
    "response_length_mean",
    "engine_idle_fraction",
    "time_rollout_s",
    "time_update_s",
)


def stage_summary_rows(steps: dict[int, dict[str, float]]) -> list[dict]:
    """One row per RL step (step -> metrics, as tables.stage_steps reads them), rounded."""
    return [
        {"step": step, **{c: round(float(m[c]), 4) for c in STAGE_SUMMARY_COLUMNS if c in m}}
        for step, m in steps.items()
    ]


def artifact_key(prefix: str, stage: str) -> str:
    """A Prefect artifact key for a stage: lower-case letters, digits and dashes only."""
    return f"{prefix}-" + "".join(c if c.isalnum() else "-" for c in stage.lower())


def evaluation_markdown(run_dir: Path) -> str:
    """pass@1 of every evaluated checkpoint (rows, in evaluation order) on every benchmark."""
    rows = evaluation_rows(run_dir)
    checkpoints = list(dict.fromkeys(r["checkpoint"] for r in rows))
    benchmarks = list(dict.fromkeys(r["benchmark"] for r in rows))
    value = {(r["checkpoint"], r["benchmark"]): r["pass_at_1"] for r in rows}
    lines = [
        "| checkpoint | " + " | ".join(f"{b} pass@1" for b in benchmarks) + " |",
        "|---|" + "---|" * len(benchmarks),
    ]
    for checkpoint in checkpoints:
        cells = [f"{value[(checkpoint, b)]:.3f}" if (checkpoint, b) in value else "" for b in benchmarks]
        lines.append(f"| {checkpoint} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def _cell(value) -> str:
    return f"{value:.3f}" if isinstance(value, float) else ("" if value is None else str(value))


def report_card(run_id: str, run_dir: Path, rows: list[dict], wall_s: float) -> str:
    """The report card as Markdown (stages, then evaluations); printed as a table on the way."""
    shown = [{**row, "wall s": f"{row['wall s']:.0f}"} for row in rows]
    table = Table(title=f"rstar2-pipeline run {run_id} ({wall_s:.0f} s)")
    for column in SUMMARY_COLUMNS:
        table.add_column(column, justify="left" if column == "stage" else "right")
    for row in shown:
        table.add_row(*(_cell(row.get(column)) for column in SUMMARY_COLUMNS))
    Console(width=120).print(table)
    stages = "| " + " | ".join(SUMMARY_COLUMNS) + " |\n|" + "---|" * len(SUMMARY_COLUMNS) + "\n"
    stages += "".join("| " + " | ".join(_cell(r.get(c)) for c in SUMMARY_COLUMNS) + " |\n" for r in shown)
    evaluations = evaluation_markdown(run_dir)
    print(evaluations)
    return (
        f"# Run {run_id}\n\nwall time {wall_s:.0f} s, outputs in `{run_dir}`\n\n{stages}"
        f"\n## Evaluations (avg@k pass@1)\n\n{evaluations}"
    )
