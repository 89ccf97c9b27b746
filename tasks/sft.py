"""Prefect tasks of the base-model and SFT stages."""

from __future__ import annotations

import random
from collections.abc import Iterator
from pathlib import Path

from prefect import task
from prefect.cache_policies import NO_CACHE
from tqdm import tqdm
from transformers import AutoTokenizer

from tasks.config import OptimConfig, RunConfig, TinyModelConfig
from tasks.curate import load_problems
from tasks.data.pretrain import copy_documents, pack_documents, pretraining_documents
from tasks.data.sft import Segments, build_sft_examples, chats_from_file, tokenize_segments
from tasks.rl.batch import Sample
from tasks.runtime import RunContext
from tasks.train.tiny_model import build_tiny_model
from tasks.train.trainer import Trainer


def sft_examples(cfg: RunConfig, ctx: RunContext | None = None, recovery: bool = True) -> list[Segments]:
    """Every configured SFT source's examples; per source, how many were used and set aside
    (printed, and logged to the run's MLflow parent run when `ctx` is given). `recovery`: False
    leaves out the generated examples that recover from a failed call."""
    examples: list[Segments] = []
    counts: dict[str, float] = {}
    for source in cfg.sft.sources:
        if source.format == "generated":
            share = cfg.sft.recovery_share if recovery else 0.0
            found, rejected = build_sft_examples(cfg.sft.n_examples, cfg.data.levels, cfg.seed, cfg.rollout.tool_name,
                                                 cfg.rollout.tool_spec, recovery_share=share), []
        else:
            found, rejected = chats_from_file(source.name, source.format, source.path, source.messages, source.tools,
                                              source.limit, cfg.rollout.tool_name, cfg.rollout.tool_spec)
        examples += found
        counts[f"sft/{source.name}/examples"], counts[f"sft/{source.name}/rejected"] = len(found), len(rejected)
        reasons = "; ".join(f"{r.row_id}: {r.reason}" for r in rejected[:5])
        aside = f" ({reasons})" if reasons else ""
        print(f"sft source {source.name}: {len(found)} examples, {len(rejected)} set aside{aside}")
    if ctx is not None:
        ctx.tracker.log_metrics(ctx.mlflow_run_id, counts)
    return examples


def pretraining_phases(tokenizer, tiny: TinyModelConfig, levels: list[int],
                       seed: int) -> list[tuple[list[Sample], int]]:
    """(packed samples, optimizer steps) per phase of the tiny model's pre-training: copy drills
    first, so the copy mechanism forms, then problem documents."""
    copy_steps = round(tiny.pretrain_steps * tiny.pretrain_copy_share)
    phases = []
    for documents, steps in ((copy_documents, copy_steps), (None, tiny.pretrain_steps - copy_steps)):
        if not steps:
            continue
        n = steps * tiny.pretrain_batch_size * 8  # documents are far shorter than a sequence
        texts = copy_documents(n, seed + 5) if documents else pretraining_documents(n, levels, seed + 2_000_003)
        packed = pack_documents(tokenizer, texts, tiny.pretrain_seq_len)
        phases.append(([Sample(ids, [1] * len(ids)) for ids in packed], steps))
    return phases


@task(cache_policy=NO_CACHE)
def build_base_model(cfg: RunConfig, ctx: RunContext, train_path: Path, stage_run_id: str) -> tuple[Path, int]:
    """A real model directory from the config, or the tiny model built (and pre-trained) from
    scratch; returns the directory and the pre-training steps."""
    if cfg.model.path:
        return Path(cfg.model.path), 0
    tiny = cfg.model.tiny
    corpus = [p.question + "\n" + p.solution_code for p in load_problems(train_path)]
    # The tokenizer learns the chat format from SFT examples, but not their broken calls and
    # tracebacks: a base model that changed with sft.recovery_share would confound comparing it.
    corpus += ["".join(text for text, _ in example) for example in sft_examples(cfg, recovery=False)]
    model_dir = build_tiny_model(tiny, corpus, cfg.seed, ctx.run_dir / "models" / "base")
    if tiny.pretrain_steps:
        tokenizer = AutoTokenizer.from_pretrained(model_dir)
        # Constant after warm-up: a decaying rate slowed the problem phase that follows the drills.
        # Micro-batches of 8 sequences: 9% faster than 16 on two cores, the same gradient (LOG.md).
        optim = OptimConfig(lr=tiny.pretrain_lr, schedule="constant", warmup_steps=tiny.pretrain_steps // 40,
                            zero_stage=1, micro_batch_size=8)
        trainer = Trainer(model_dir, optim, tiny.pretrain_steps, cfg.model.dtype, cfg.seed, cfg.trainer_threads)
        first = 0
        for samples, steps in pretraining_phases(tokenizer, tiny, cfg.data.levels, cfg.seed):
            _train(trainer, samples, tiny.pretrain_batch_size, steps, "pretrain", ctx, stage_run_id, cfg.seed, first)
            first += steps
        trainer.save_pretrained(model_dir)
    return model_dir, tiny.pretrain_steps


def epoch_batches(samples: list[Sample], batch_size: int, steps: int, seed: int) -> Iterator[list[Sample]]:
    """`steps` batches over shuffled epochs of the samples (shuffled in place, seeded)."""
    steps_per_epoch = max(len(samples) // batch_size, 1)
    rng = random.Random(seed)
    for step in range(steps):
        if step % steps_per_epoch == 0:
            rng.shuffle(samples)
        start = (step % steps_per_epoch) * batch_size
        yield samples[start : start + batch_size]


def _train(trainer: Trainer, samples: list[Sample], batch_size: int, steps: int, desc: str,
           ctx: RunContext, stage_run_id: str, seed: int, first_step: int = 0) -> None:
    """`steps` optimizer steps over shuffled epochs of the samples, with a progress bar; metrics
    are logged from `first_step` on (a later phase of the same training continues the curve)."""
    tracker = ctx.tracker
    with tqdm(total=steps, desc=desc, disable=None) as progress:
        for step, batch in enumerate(epoch_batches(samples, batch_size, steps, seed)):
            metrics = trainer.sft_step(batch)
            tracker.log_metrics(stage_run_id, {f"{desc}/{k}": v for k, v in metrics.items()}, first_step + step)
            progress.set_postfix(loss=f"{metrics['loss']:.3f}")
            progress.update(1)


@task(cache_policy=NO_CACHE)
def train_sft(cfg: RunConfig, ctx: RunContext, base_dir: Path, stage_run_id: str) -> tuple[Path, int]:
    """Non-reasoning SFT with the DeepSpeed trainer; returns the SFT model directory and steps."""
    tokenizer = AutoTokenizer.from_pretrained(base_dir)
    samples = []
    for example in sft_examples(cfg, ctx):
        ids, mask = tokenize_segments(tokenizer, example)
        if len(ids) <= cfg.sft.max_len:  # longer examples would be cut mid-format
            samples.append(Sample(ids, mask))
    total = max(len(samples) // cfg.sft.batch_size, 1) * cfg.sft.epochs
    optim = cfg.sft.optim.model_copy(update={"warmup_steps": round(cfg.sft.warmup_ratio * total)})
    trainer = Trainer(base_dir, optim, total, cfg.model.dtype, cfg.seed, cfg.trainer_threads)
    _train(trainer, samples, cfg.sft.batch_size, total, "sft", ctx, stage_run_id, cfg.seed)
    out = trainer.save_pretrained(ctx.run_dir / "models" / "sft")
    tokenizer.save_pretrained(out)
    return out, total
