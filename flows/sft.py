"""Non-reasoning SFT: tool-call formatting and instruction following, no math traces."""

from pathlib import Path

from prefect import flow

from tasks.config import RunConfig
from tasks.report import end_run, start_stage_run
from tasks.runtime import RunContext
from tasks.sft import train_sft


@flow(name="sft", log_prints=True, validate_parameters=False)
def sft(cfg: RunConfig, ctx: RunContext, base_dir: Path) -> tuple[Path, int]:
    stage_run = start_stage_run(ctx, "sft", cfg.sft.model_dump(mode="json"))
    model_dir, steps = train_sft(cfg, ctx, base_dir, stage_run)
    end_run(ctx, stage_run)
    return model_dir, steps
