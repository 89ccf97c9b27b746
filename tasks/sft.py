"""Prefect tasks of the base-model and SFT stages (library: tasks/train/supervised.py)."""

from __future__ import annotations

from pathlib import Path

from prefect import task
from prefect.cache_policies import NO_CACHE

from tasks.config import RunConfig
from tasks.data.chat_examples import sft_examples
from tasks.data.problem_sets import load_problems
from tasks.records import RunContext
from tasks.runtime import Runtime
from tasks.tracking.mlflow_log import Tracker
from tasks.train import supervised


@task(cache_policy=NO_CACHE)
def build_base_model(cfg: RunConfig, ctx: RunContext, train_path: Path, stage_run_id: str) -> tuple[Path, int]:
    """A real model directory from the config, or the tiny model built (and pre-trained) from
    scratch; returns the directory and the pre-training steps."""
    tracker = Tracker(ctx.output_dir)
    return supervised.build_base_model(
        cfg,
        load_problems(train_path),
        ctx.policy_dir("base"),
        tracker.step_logger(stage_run_id, "pretrain/loss"),
    )


@task(cache_policy=NO_CACHE)
def train_sft(cfg: RunConfig, ctx: RunContext, runtime: Runtime, base_dir: Path, stage_run_id: str) -> tuple[Path, int]:
    """Non-reasoning SFT on the run's trainer ranks; returns the SFT model directory and steps.
    How many examples each source gave, and set aside, go to the run's MLflow parent run."""
    tracker = Tracker(ctx.output_dir)
    examples, counts = sft_examples(cfg)
    tracker.log_metrics(ctx.mlflow_run_id, counts)
    return supervised.train_sft(
        cfg,
        examples,
        base_dir,
        ctx.policy_dir("sft"),
        tracker.step_logger(stage_run_id, "sft/loss"),
        runtime.supervised_trainer,
    )
