"""Prefect tasks of the comparison flows (library: tasks/summary/mode_comparison.py and cold_start.py;
a run seeded from another: tasks/store/run_folder.py)."""

from __future__ import annotations

from pathlib import Path

from prefect import task
from prefect.cache_policies import NO_CACHE

from tasks.config import RunConfig
from tasks.store import run_folder
from tasks.summary import async_comparison, cold_start, mode_comparison, runs
from tasks.summary.runs import RunResult


@task(cache_policy=NO_CACHE)
def start_from_run(source: Path, target: Path, cfg: RunConfig, upto: str) -> None:
    run_folder.start_from_run(source, target, cfg, upto)


@task(cache_policy=NO_CACHE)
def arm_source(runs_dir: Path, name: str, seed: int, arm: str, first_arm: str, sft_from: str | None) -> Path | None:
    return run_folder.arm_source(runs_dir, name, seed, arm, first_arm, sft_from)


@task(cache_policy=NO_CACHE)
def read_run(run_dir: Path, seed: int, mode: str, stage_names: list[str]) -> RunResult:
    return runs.read_run(run_dir, seed, mode, stage_names)


@task(cache_policy=NO_CACHE)
def write_ablation_report(results: list[RunResult], out_dir: Path, command: str) -> Path:
    return mode_comparison.write_report(results, out_dir, command)


@task(cache_policy=NO_CACHE)
def write_cold_start_report(results: list[RunResult], out_dir: Path, command: str) -> Path:
    return cold_start.write_report(results, out_dir, command)


@task(cache_policy=NO_CACHE)
def write_async_report(results: list[RunResult], out_dir: Path, command: str) -> Path:
    return async_comparison.write_report(results, out_dir, command)
