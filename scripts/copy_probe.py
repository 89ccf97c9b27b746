"""Does the tiny model learn to copy? The skill every generated problem needs (numbers from the
question into the program, the printed value into the answer), measured during pre-training.

Builds the tiny model as the pipeline does, pre-trains it on `question\\nprogram` documents
after a first phase of copy drills (`Repeat: <numbers>\\n<numbers>`), as the pipeline does, and every
--every steps greedy-decodes the program after `question\\n` for 64 problems from a fresh seed:
`exact` is the share of programs exactly right, `numbers` the share of the question's numbers
found in the program (chance is ~0.15-0.2: small numbers recur in every template). LOG.md has the
results that motivated it. Example:

    .venv/bin/python scripts/copy_probe.py --steps 800 --lr 3e-4 --copy-share 0.5
"""

from __future__ import annotations

import argparse
import json
import re
import tempfile
import time
from pathlib import Path

import torch
from transformers import AutoTokenizer

from tasks.config import OptimConfig, TinyModelConfig
from tasks.data.pretrain import pretraining_phases
from tasks.data.problems import generate_problems
from tasks.train.supervised import epoch_batches
from tasks.train.tiny_model import build_tiny_model
from tasks.train.trainer import Trainer

LEVELS = [1, 2, 3]


@torch.no_grad()
def probe(model, tokenizer, problems) -> tuple[float, float]:
    model.eval()
    exact = found = total = 0
    for p in problems:
        ids = tokenizer(p.question + "\n", return_tensors="pt").input_ids
        out = model.generate(ids, max_new_tokens=60, do_sample=False, pad_token_id=tokenizer.pad_token_id)
        program = tokenizer.decode(out[0, ids.shape[1] :], skip_special_tokens=True)
        exact += program.startswith(p.solution_code)
        wanted = re.findall(r"\d+", p.question)
        written = set(re.findall(r"\d+", program.split("\n\n")[0]))
        total += len(wanted)
        found += sum(n in written for n in wanted)
    model.train()
    return exact / len(problems), found / max(total, 1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=800)
    parser.add_argument("--copy-share", type=float, default=0.5, help="share of the steps spent on copy drills first")
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--lr", type=float, default=3e-4)
    parser.add_argument("--kv-heads", type=int, default=3)
    parser.add_argument("--every", type=int, default=100)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()

    tiny = TinyModelConfig(
        vocab_size=2048,
        hidden_size=192,
        num_layers=4,
        num_heads=3,
        num_kv_heads=args.kv_heads,
        intermediate_size=512,
        max_position_embeddings=1024,
        pretrain_steps=args.steps,
        pretrain_copy_share=args.copy_share,
        pretrain_batch_size=args.batch,
        pretrain_seq_len=args.seq_len,
        pretrain_lr=args.lr,
    )
    corpus = [p.question + "\n" + p.solution_code for p in generate_problems(256, LEVELS, 0)]
    model_dir = build_tiny_model(tiny, corpus, 0, Path(tempfile.mkdtemp(prefix="copy-probe-")))
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    optim = OptimConfig(
        lr=args.lr, schedule="constant", warmup_steps=args.steps // 40, zero_stage=1, micro_batch_size=16
    )
    trainer = Trainer(model_dir, optim, args.steps, "float32", 0, args.threads)
    problems = generate_problems(64, LEVELS, seed=777)
    step, started = 0, time.perf_counter()
    for samples, steps in pretraining_phases(tokenizer, tiny, LEVELS, seed=0):
        for batch in epoch_batches(samples, args.batch, steps, seed=0):
            metrics = trainer.sft_step(batch)
            step += 1
            if step % args.every == 0:
                exact, numbers = probe(trainer.engine.module, tokenizer, problems)
                print(
                    json.dumps(
                        {
                            "step": step,
                            "loss": round(metrics["loss"], 3),
                            "exact": exact,
                            "numbers": round(numbers, 3),
                            "s": round(time.perf_counter() - started),
                        }
                    ),
                    flush=True,
                )


if __name__ == "__main__":
    main()
