"""Prefect tasks of the base-model and SFT stages."""

from __future__ import annotations

import random
from pathlib import Path

from prefect import task
from prefect.cache_policies import NO_CACHE
from tqdm import tqdm
from transformers import AutoTokenizer

from tasks.config import RunConfig
from tasks.curate import load_problems
from tasks.data.sft import build_sft_examples, tokenize_segments
from tasks.rl.batch import Sample
from tasks.runtime import RunContext
from tasks.train.tiny_model import build_tiny_model
from tasks.train.trainer import Trainer


def _sft_examples(cfg: RunConfig):
    return build_sft_examples(cfg.sft.n_examples, cfg.data.levels, cfg.seed, cfg.rollout.tool_name,
                              cfg.rollout.tool_spec)


@task(cache_policy=NO_CACHE)
def build_base_model(cfg: RunConfig, run_dir: Path, train_path: Path) -> Path:
    """A real model directory from the config, or the tiny model trained from scratch."""
    if cfg.model.path:
        return Path(cfg.model.path)
    corpus = [p.question + "\n" + p.solution_code for p in load_problems(train_path)]
    corpus += ["".join(text for text, _ in example) for example in _sft_examples(cfg)]
    return build_tiny_model(cfg.model.tiny, corpus, cfg.seed, run_dir / "models" / "base")


@task(cache_policy=NO_CACHE)
def train_sft(cfg: RunConfig, ctx: RunContext, base_dir: Path, stage_run_id: str) -> tuple[Path, int]:
    """Non-reasoning SFT with the DeepSpeed trainer; returns the SFT model directory and steps."""
    tokenizer = AutoTokenizer.from_pretrained(base_dir)
    samples = []
    for example in _sft_examples(cfg):
        ids, mask = tokenize_segments(tokenizer, example)
        if len(ids) <= cfg.sft.max_len:  # longer examples would be cut mid-format
            samples.append(Sample(ids, mask))
    steps_per_epoch = -(-len(samples) // cfg.sft.batch_size)
    total = steps_per_epoch * cfg.sft.epochs
    optim = cfg.sft.optim.model_copy(update={"warmup_steps": round(cfg.sft.warmup_ratio * total)})
    trainer = Trainer(base_dir, optim, total, cfg.model.dtype, cfg.seed, cfg.trainer_threads)
    rng = random.Random(cfg.seed)
    tracker = ctx.tracker
    with tqdm(total=total, desc="sft", disable=None) as progress:
        for step in range(total):
            if step % steps_per_epoch == 0:
                rng.shuffle(samples)
            start = (step % steps_per_epoch) * cfg.sft.batch_size
            metrics = trainer.sft_step(samples[start : start + cfg.sft.batch_size])
            tracker.log_metrics(stage_run_id, {f"sft/{k}": v for k, v in metrics.items()}, step)
            progress.set_postfix(loss=f"{metrics['loss']:.3f}")
            progress.update(1)
    out = trainer.save_pretrained(ctx.run_dir / "models" / "sft")
    tokenizer.save_pretrained(out)
    return out, total
