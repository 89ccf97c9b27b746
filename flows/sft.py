"""The base model and the non-reasoning SFT (tool-call formatting and instruction following)."""

from pathlib import Path

from prefect import flow

from flows.once import run_once
from tasks.config import RunConfig
from tasks.records import RunContext
from tasks.runtime import Runtime
from tasks.sft import build_base_model, train_sft


@flow(name="base-model", log_prints=True, validate_parameters=False)
def base_model(cfg: RunConfig, ctx: RunContext, train_path: Path) -> list:
    """[model dir, pre-training steps]: the configured model, or the tiny one built and pre-trained."""
    return run_once(
        ctx,
        "base",
        lambda stage_run: build_base_model(cfg, ctx, train_path, stage_run),
        mlflow_stage="base",
        params=cfg.model.model_dump(mode="json"),
    )


@flow(name="sft", log_prints=True, validate_parameters=False)
def sft(cfg: RunConfig, ctx: RunContext, runtime: Runtime, base_dir: Path) -> list:
    """[model dir, steps] of the SFT policy, trained on the runtime's trainer ranks."""
    return run_once(
        ctx,
        "sft",
        lambda stage_run: train_sft(cfg, ctx, runtime, base_dir, stage_run),
        mlflow_stage="sft",
        params=cfg.sft.model_dump(mode="json"),
    )
