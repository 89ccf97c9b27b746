"""Supervised training with the DeepSpeed trainer: the tiny base model's pre-training and the
non-reasoning SFT. Metrics go to a `log(metrics, step)` callable, so this stays free of MLflow."""

from __future__ import annotations

import random
from collections.abc import Callable, Iterator
from pathlib import Path

from tqdm import tqdm
from transformers import AutoTokenizer

from tasks.config import OptimConfig, RunConfig
from tasks.data.chat_examples import Segments, sft_examples, tokenize_segments
from tasks.data.pretrain import copy_drill_samples, copy_probe_samples, document_samples
from tasks.records import Problem, Sample
from tasks.train.tiny_model import build_tiny_model
from tasks.train.trainer import Trainer

Log = Callable[[dict[str, float], int], None]
# (model directory, optimizer settings, total steps) -> a trainer with sft_step and save_pretrained
StartTrainer = Callable[[Path, OptimConfig, int], Trainer]


def epoch_batches(samples: list[Sample], batch_size: int, steps: int, seed: int) -> Iterator[list[Sample]]:
    """`steps` batches over shuffled epochs of the samples (shuffled in place, seeded)."""
    steps_per_epoch = max(len(samples) // batch_size, 1)
    rng = random.Random(seed)
    for step in range(steps):
        if step % steps_per_epoch == 0:
            rng.shuffle(samples)
        start = (step % steps_per_epoch) * batch_size
        yield samples[start : start + batch_size]


def train_steps(
    trainer: Trainer,
    samples: list[Sample],
    batch_size: int,
    steps: int,
    seed: int,
    desc: str,
    log: Log,
    first_step: int = 0,
    until: Callable[[int], bool] | None = None,
) -> int:
    """At most `steps` optimizer steps over shuffled epochs of the samples, with a progress bar;
    metrics are logged as `<desc>/<name>` from `first_step` on (a later phase continues the
    curve). `until(step)`, asked every 25 steps, ends the loop early. Returns the steps taken."""
    taken = 0
    with tqdm(total=steps, desc=desc, disable=None) as progress:
        for step, batch in enumerate(epoch_batches(samples, batch_size, steps, seed)):
            metrics = trainer.sft_step(batch)
            log({f"{desc}/{k}": v for k, v in metrics.items()}, first_step + step)
            progress.set_postfix(loss=f"{metrics['loss']:.3f}")
            progress.update(1)
            taken = step + 1
            if until and taken % 25 == 0 and until(first_step + step):
                break
    return taken


def build_base_model(cfg: RunConfig, train: list[Problem], model_dir: Path, log: Log) -> tuple[Path, int]:
    """A real model directory from the config, or the tiny model built in `model_dir` (tokenizer
    from the training problems' statements and programs and the SFT examples) and pre-trained;
    returns the directory and the pre-training steps."""
    if cfg.model.path:
        return Path(cfg.model.path), 0
    tiny = cfg.model.tiny
    corpus = [p.question + "\n" + p.solution_code for p in train]
    # The tokenizer learns the chat format from SFT examples, but not their broken calls and
    # tracebacks, and always from the same mode's: a base model that changed with
    # sft.recovery_share or sft.mode would confound comparing them.
    examples = sft_examples(cfg, recovery=False, mode="non_reasoning")[0]
    corpus += ["".join(text for text, _ in example) for example in examples]
    model_dir = build_tiny_model(tiny, corpus, cfg.seed, model_dir, cfg.rollout.tool_name)
    steps = tiny.pretrain_copy_steps + tiny.pretrain_steps
    if steps:
        tokenizer = AutoTokenizer.from_pretrained(model_dir)
        # Constant after warm-up: a decaying rate slowed the problem phase that follows the drills.
        # Micro-batches of 8 sequences: 9% faster than 16 on two cores, the same gradient.
        optim = OptimConfig(lr=tiny.pretrain_lr, schedule="constant", warmup_steps=steps // 40, micro_batch_size=8)
        trainer = Trainer(model_dir, optim, steps, cfg.model.dtype, cfg.seed, cfg.trainer.threads, zero_stage=1)
        drills = copy_drill_samples(tokenizer, tiny, cfg.seed)
        probe = copy_probe_samples(tokenizer, 64, cfg.seed + 7)
        formed: list[int] = []

        def copying(step: int) -> bool:
            # The copy mechanism forms suddenly, after a number of steps that varies with the
            # initialisation (300 to 550 seen); documents before it teach no program.
            exact = trainer.exact_match(probe)
            log({"pretrain/copy_exact": exact}, step)
            if exact >= tiny.pretrain_copy_until:
                formed.append(step + 1)
                # The check ends the drills at its first pass, so the share it saw is the largest
                # of noisy measurements: the same check on drills it never saw says what holds.
                unseen = trainer.exact_match(copy_probe_samples(tokenizer, 64, cfg.seed + 13))
                log({"pretrain/copy_exact_unseen": unseen}, step)
                print(
                    f"copy drills: copying formed by step {step + 1} (fresh drills copied exactly: {exact:.2f}; "
                    f"unseen ones: {unseen:.2f})"
                )
            return bool(formed)

        copy_steps = train_steps(
            trainer, drills, tiny.pretrain_batch_size, tiny.pretrain_copy_steps, cfg.seed, "pretrain", log, 0, copying
        )
        if copy_steps and not formed:
            print(f"copy drills: copying had not formed after {copy_steps} steps; the base model may not copy numbers")
        documents = document_samples(tokenizer, cfg, cfg.seed)
        batch = tiny.pretrain_batch_size
        train_steps(trainer, documents, batch, tiny.pretrain_steps, cfg.seed, "pretrain", log, copy_steps)
        trainer.save_pretrained(model_dir)
        steps = copy_steps + tiny.pretrain_steps
    return model_dir, steps


def sft_samples(cfg: RunConfig, examples: list[Segments], tokenizer) -> list[Sample]:
    """The examples as samples (those longer than sft.max_len left out: they would be cut
    mid-format), and for the tiny model a `replay_share` of pre-training documents."""
    samples = []
    for example in examples:
        ids, mask = tokenize_segments(tokenizer, example)
        if len(ids) <= cfg.sft.max_len:
            samples.append(Sample(ids, mask))
    if cfg.sft.replay_share and not cfg.model.path:
        replay = document_samples(tokenizer, cfg, cfg.seed + 1)
        samples += replay[: round(len(samples) * cfg.sft.replay_share / (1 - cfg.sft.replay_share))]
    return samples


def train_sft(
    cfg: RunConfig, examples: list[Segments], base_dir: Path, out_dir: Path, log: Log, start_trainer: StartTrainer
) -> tuple[Path, int]:
    """SFT of the base policy on the examples, with the trainer `start_trainer`
    starts (the run's trainer ranks); returns the SFT model directory (`out_dir`, tokenizer
    included) and its steps."""
    tokenizer = AutoTokenizer.from_pretrained(base_dir)
    samples = sft_samples(cfg, examples, tokenizer)
    total = max(len(samples) // cfg.sft.batch_size, 1) * cfg.sft.epochs
    optim = cfg.sft.optim.model_copy(update={"warmup_steps": round(cfg.sft.warmup_ratio * total)})
    trainer = start_trainer(base_dir, optim, total)
    train_steps(trainer, samples, cfg.sft.batch_size, total, cfg.seed, "sft", log)
    out = trainer.save_pretrained(out_dir)
    tokenizer.save_pretrained(out)
    return out, total
