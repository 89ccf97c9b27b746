"""The RoC ablation: the pipeline per (seed, RoC mode), then one report comparing them."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from prefect import flow

from flows.pipeline import pipeline
from tasks.ablation import read_run, sft_run_of, start_from_sft_of, write_ablation_report
from tasks.config import default_config_path, load_config
from tasks.config.preflight import check_run
from tasks.summary.mode_comparison import ablation_command


@flow(name="rstar2-ablate", log_prints=True)
def ablate(
    config: str = str(default_config_path()),
    seeds: int = 3,
    modes: list[str] | None = None,
    overrides: dict[str, Any] | None = None,
    name: str = "roc",
    sft_from: str | None = None,
) -> str:
    """Runs `<name>-s<seed>-<mode>` for seeds 0..seeds-1 and each RoC mode (paper, release, off);
    a seed's later modes start from its first mode's SFT policy, and with `sft_from` (the name of
    an earlier ablation) every mode starts from that ablation's SFT policy of the seed: a paired
    comparison of RL settings. Re-running with the same name resumes. Returns the report's path
    (outputs/ablations/<name>/report.md)."""
    modes = modes or ["paper", "release", "off"]
    cfg = load_config(config, overrides)
    check_run(cfg)  # before a run folder gets a copy of an SFT policy
    results = []
    for seed in range(seeds):
        first = f"{name}-s{seed}-{modes[0]}"
        for mode in modes:
            run_id = f"{name}-s{seed}-{mode}"
            run_overrides = {**(overrides or {}), "seed": seed, "rl.roc.mode": mode}
            source = (
                cfg.run_dir(first)
                if mode != modes[0]
                else (sft_run_of(Path(cfg.output_dir) / "runs", sft_from, seed) if sft_from else None)
            )
            if source is not None:
                start_from_sft_of(source, cfg.run_dir(run_id), load_config(config, run_overrides))
            pipeline(config, run_id, run_overrides)
            results.append(read_run(cfg.run_dir(run_id), seed, mode, [s.name for s in cfg.rl.stages]))
    command = ablation_command(config, seeds, modes, overrides or {}, name, sft_from)
    return str(write_ablation_report(results, Path(cfg.output_dir) / "ablations" / name, command))
