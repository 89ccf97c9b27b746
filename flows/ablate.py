"""Comparisons over seeds, the pipeline per (seed, arm), then one report: the RoC ablation (arms
are `rl.roc.mode`s), the cold-start experiment (arms are `sft.mode`s) and rl.async against
on-policy training (arms are `rl.async.mode`s)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from prefect import flow

from flows.pipeline import pipeline
from flows.preflight import check_run
from tasks.ablation import (
    arm_source,
    read_run,
    start_from_run,
    write_ablation_report,
    write_async_report,
    write_cold_start_report,
)
from tasks.config import default_config_path, load_config
from tasks.store.run_folder import run_dir
from tasks.summary.mode_comparison import ablation_command
from tasks.summary.runs import RunResult


def run_arms(
    config: str,
    seeds: int,
    arms: dict[str, dict[str, Any]],
    overrides: dict[str, Any] | None,
    name: str,
    upto: str,
    sft_from: str | None = None,
) -> list[RunResult]:
    """Runs `<name>-s<seed>-<arm>`, each arm with its own overrides on top of `overrides`; a
    seed's later arms start from its first arm's run after the `upto` policy, and with `sft_from`
    (the name of an earlier ablation) every arm starts from that ablation's SFT policy of the
    seed. Re-running with the same name resumes."""
    cfg = load_config(config, overrides)
    check_run(cfg)  # before a run folder gets a copy of a policy
    first_arm, runs_dir = next(iter(arms)), Path(cfg.output_dir) / "runs"
    results = []
    for seed in range(seeds):
        for arm, arm_overrides in arms.items():
            run_id = f"{name}-s{seed}-{arm}"
            run_overrides = {**(overrides or {}), "seed": seed, **arm_overrides}
            source = arm_source(runs_dir, name, seed, arm, first_arm, sft_from)
            if source is not None:
                start_from_run(source, run_dir(cfg.output_dir, run_id), load_config(config, run_overrides), upto)
            pipeline(config, run_id, run_overrides)
            results.append(read_run(run_dir(cfg.output_dir, run_id), seed, arm, [s.name for s in cfg.rl.stages]))
    return results


@flow(name="rstar2-ablate", log_prints=True)
def ablate(
    config: str = str(default_config_path()),
    seeds: int = 3,
    modes: list[str] | None = None,
    overrides: dict[str, Any] | None = None,
    name: str = "roc",
    sft_from: str | None = None,
) -> str:
    """The RoC ablation: each RoC mode (paper, release, off) from one SFT policy per seed (or
    ablation `sft_from`'s): a paired comparison of RL settings. Returns the report's path
    (outputs/ablations/<name>/report.md)."""
    modes = modes or ["paper", "release", "off"]
    results = run_arms(config, seeds, {m: {"rl.roc.mode": m} for m in modes}, overrides, name, "sft", sft_from)
    command = ablation_command(config, seeds, modes, overrides or {}, name, sft_from)
    out_dir = Path(load_config(config, overrides).output_dir) / "ablations" / name
    return str(write_ablation_report(results, out_dir, command))


@flow(name="rstar2-cold-start", log_prints=True)
def cold_start(
    config: str = str(default_config_path()),
    seeds: int = 3,
    arms: list[str] | None = None,
    overrides: dict[str, Any] | None = None,
    name: str = "coldstart",
) -> str:
    """The paper's cold-start question: the same RL stages from a non-reasoning SFT policy and
    from a reasoning one, each seed's arms from one base model. Returns the report's path
    (outputs/ablations/<name>/report.md)."""
    arms = arms or ["non_reasoning", "reasoning"]
    results = run_arms(config, seeds, {a: {"sft.mode": a} for a in arms}, overrides, name, "base")
    command = ablation_command(config, seeds, arms, overrides or {}, name, command="coldstart", arms_flag="--arms")
    out_dir = Path(load_config(config, overrides).output_dir) / "ablations" / name
    return str(write_cold_start_report(results, out_dir, command))


@flow(name="rstar2-async-comparison", log_prints=True)
def async_comparison(
    config: str = str(default_config_path()),
    seeds: int = 3,
    modes: list[str] | None = None,
    is_cap: float = 2.0,
    overrides: dict[str, Any] | None = None,
    name: str = "async",
) -> str:
    """rl.async against on-policy training: each mode (off, one_step, bounded) from one SFT policy
    per seed; the off-policy modes with the importance-sampling correction capped at `is_cap`.
    Returns the report's path (outputs/ablations/<name>/report.md)."""
    modes = modes or ["off", "one_step"]
    arms = {m: {"rl.async.mode": m, **({"rl.loss.is_cap": is_cap} if m != "off" else {})} for m in modes}
    results = run_arms(config, seeds, arms, overrides, name, "sft")
    command = ablation_command(config, seeds, modes, overrides or {}, name, command="async-compare")
    command += f" --is-cap {is_cap:g}"
    out_dir = Path(load_config(config, overrides).output_dir) / "ablations" / name
    return str(write_async_report(results, out_dir, command))
