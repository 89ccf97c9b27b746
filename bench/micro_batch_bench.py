"""Time per SFT step of the tiny default at several micro-batch sizes, on its real SFT examples.

An optimizer step's gradient does not depend on how its batch is cut into micro-batches (the
loss is a token mean over the whole batch; tests/test_trainer.py), but the time does: each
micro-batch pads to its longest sample. Trainers of each size step in turn, on the same batches,
so machine load hits them alike. Prints the median seconds per step, the share of padding, the
last loss (equal across sizes) and each size's speed-up over the first size given (the baseline).

    .venv/bin/python bench/micro_batch_bench.py [--sizes 16 8 4] [--steps 10] [--threads 2]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

from tqdm import tqdm
from transformers import AutoTokenizer

from tasks.config import default_config_path, load_config
from tasks.data.chat_examples import sft_examples, tokenize_segments
from tasks.records import Sample
from tasks.train.supervised import epoch_batches
from tasks.train.tiny_model import build_tiny_model
from tasks.train.trainer import Trainer, by_length


def padding_share(batches: list[list[Sample]], size: int) -> float:
    """Padded tokens / all tokens when each batch, longest first, is cut into micro-batches of `size`."""
    real = padded = 0
    for batch in batches:
        ordered = by_length(batch)
        for start in range(0, len(ordered), size):
            chunk = ordered[start : start + size]
            real += sum(len(s.token_ids) for s in chunk)
            padded += len(chunk) * max(len(s.token_ids) for s in chunk)
    return 1 - real / padded


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", type=int, nargs="+", default=[16, 8, 4])
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--threads", type=int, default=None, help="default: the config's trainer.threads")
    args = parser.parse_args()
    cfg = load_config(default_config_path())
    threads = args.threads or cfg.trainer.threads
    with tempfile.TemporaryDirectory() as tmp:
        corpus = ["".join(text for text, _ in example) for example in sft_examples(cfg, recovery=False)[0]]
        model_dir = build_tiny_model(cfg.model.tiny, corpus, seed=0, out_dir=Path(tmp) / "model")
        tokenizer = AutoTokenizer.from_pretrained(model_dir)
        samples = [Sample(*tokenize_segments(tokenizer, example)) for example in sft_examples(cfg)[0]]
        samples = [s for s in samples if len(s.token_ids) <= cfg.sft.max_len]
        batches = list(epoch_batches(samples, cfg.sft.batch_size, args.steps + 1, seed=0))
        trainers = {
            size: Trainer(
                model_dir,
                cfg.sft.optim.model_copy(update={"micro_batch_size": size}),
                total_steps=args.steps + 1,
                threads=threads,
                zero_stage=cfg.trainer.zero_stage,
            )
            for size in args.sizes
        }
        times: dict[int, list[float]] = {size: [] for size in args.sizes}
        losses: dict[int, float] = {}
        for step, batch in enumerate(tqdm(batches, desc="sft steps")):  # step 0 warms up, not counted
            for size, trainer in trainers.items():
                started = time.perf_counter()
                losses[size] = trainer.sft_step(batch)["loss"]
                if step:
                    times[size].append(time.perf_counter() - started)
    lengths = sorted(len(s.token_ids) for s in samples)
    print(
        f"{len(samples)} SFT examples, {lengths[len(lengths) // 2]} tokens median, {lengths[-1]} max; "
        f"batch {cfg.sft.batch_size}, {threads} thread(s), {args.steps} steps"
    )
    baseline = statistics.median(times[args.sizes[0]])
    for size in args.sizes:
        median = statistics.median(times[size])
        print(
            f"micro-batch {size:3d}: {median:.3f} s/step (median), padding {padding_share(batches, size):.1%}, "
            f"last loss {losses[size]:.6f}, {baseline / median:.2f}x micro-batch {args.sizes[0]}"
        )


if __name__ == "__main__":
    main()
