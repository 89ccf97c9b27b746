"""The base model and the non-reasoning SFT (tool-call formatting and instruction following)."""

from pathlib import Path

from prefect import flow

from tasks.config import RunConfig
from tasks.report import end_run, start_stage_run
from tasks.resume import finished, mark_finished
from tasks.runtime import RunContext
from tasks.sft import build_base_model, train_sft


@flow(name="base-model", log_prints=True, validate_parameters=False)
def base_model(cfg: RunConfig, ctx: RunContext, train_path: Path) -> list:
    """[model dir, pre-training steps]: the configured model, or the tiny one built and pre-trained."""
    if (done := finished(ctx, "base")) is not None:
        return done
    stage_run = start_stage_run(ctx, "base", cfg.model.model_dump(mode="json"))
    model_dir, steps = build_base_model(cfg, ctx, train_path, stage_run)
    end_run(ctx, stage_run)
    return mark_finished(ctx, "base", [model_dir, steps])


@flow(name="sft", log_prints=True, validate_parameters=False)
def sft(cfg: RunConfig, ctx: RunContext, base_dir: Path) -> list:
    """[model dir, steps] of the SFT policy."""
    if (done := finished(ctx, "sft")) is not None:
        return done
    stage_run = start_stage_run(ctx, "sft", cfg.sft.model_dump(mode="json"))
    model_dir, steps = train_sft(cfg, ctx, base_dir, stage_run)
    end_run(ctx, stage_run)
    return mark_finished(ctx, "sft", [model_dir, steps])
