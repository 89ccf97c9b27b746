"""The RoC ablation: the pipeline per (seed, RoC mode), then one report comparing them."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from prefect import flow

from flows.pipeline import pipeline
from tasks.ablation import ablation_command, read_run, start_from_sft_of, write_ablation_report
from tasks.config import default_config_path, load_config


@flow(name="rstar2-ablate", log_prints=True)
def ablate(config: str = str(default_config_path()), seeds: int = 3, modes: list[str] | None = None,
           overrides: dict[str, Any] | None = None, name: str = "roc") -> str:
    """Runs `<name>-s<seed>-<mode>` for seeds 0..seeds-1 and each RoC mode (paper, release, off);
    a seed's later modes start from its first mode's SFT policy. Re-running with the same name
    resumes. Returns the report's path (outputs/ablations/<name>/report.md)."""
    modes = modes or ["paper", "release", "off"]
    cfg = load_config(config, overrides)
    results = []
    for seed in range(seeds):
        first = f"{name}-s{seed}-{modes[0]}"
        for mode in modes:
            run_id = f"{name}-s{seed}-{mode}"
            if mode != modes[0]:
                start_from_sft_of(cfg.run_dir(first), cfg.run_dir(run_id))
            pipeline(config, run_id, {**(overrides or {}), "seed": seed, "rl.roc.mode": mode})
            results.append(read_run(cfg.run_dir(run_id), seed, mode, [s.name for s in cfg.rl.stages]))
    command = ablation_command(config, seeds, modes, overrides or {}, name)
    return str(write_ablation_report(results, Path(cfg.output_dir) / "ablations" / name, command))
