"""Time per RL update: the DeepSpeed trainer vs a plain torch AdamW loop, same model and batch.

Both run in this process, interleaved step by step so machine load hits them alike, with the
same micro-batching, token-mean PPO-clip loss and gradient clipping. Prints the median seconds
per update of each and their ratio (target: DeepSpeed <= 1.3x plain torch).

    .venv/bin/python bench/trainer_bench.py [--steps 10] [--zero-stage 1] [--threads 1]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM

from tasks.config import LossConfig, OptimConfig, default_config_path, load_config
from tasks.data.problems import generate_problems
from tasks.records import Sample
from tasks.rl.loss import ppo_clip_loss, token_logprobs
from tasks.train.tiny_model import build_tiny_model
from tasks.train.trainer import Trainer


def rl_batch(n: int, length: int, vocab: int, seed: int) -> list[Sample]:
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(5, vocab, (n, length), generator=gen).tolist()
    return [
        Sample(row, [0] * (length // 2) + [1] * (length - length // 2), 1.0 if i % 2 else -1.0)
        for i, row in enumerate(ids)
    ]


class PlainTorch:
    """The reference: the same update written directly with torch.optim.AdamW."""

    def __init__(self, model_dir: Path, optim: OptimConfig):
        self.model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        self.optimizer = torch.optim.AdamW(
            self.model.parameters(), lr=optim.lr, betas=optim.betas, weight_decay=optim.weight_decay
        )
        self.optim = optim

    def rl_step(self, samples: list[Sample], loss_cfg: LossConfig) -> None:
        size = self.optim.micro_batch_size
        chunks = [samples[i : i + size] for i in range(0, len(samples), size)]
        tensors = []
        for chunk in chunks:
            ids = torch.tensor([s.token_ids for s in chunk])
            mask = torch.tensor([s.loss_mask[1:] for s in chunk], dtype=torch.float32)
            tensors.append((ids, mask, torch.tensor([s.advantage for s in chunk])))
        num_tokens = int(sum(m.sum().item() for _, m, _ in tensors))
        for ids, mask, adv in tensors:
            logp = token_logprobs(self.model(input_ids=ids).logits[:, :-1].float(), ids[:, 1:])
            loss, _ = ppo_clip_loss(
                logp,
                logp.detach(),
                adv,
                mask,
                loss_cfg.eps_low,
                loss_cfg.eps_high,
                loss_cfg.dual_clip,
                num_tokens=num_tokens,
            )
            loss.backward()
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.optim.grad_clip)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--samples", type=int, default=32)
    parser.add_argument("--length", type=int, default=200)
    parser.add_argument("--zero-stage", type=int, default=1)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    cfg = load_config(default_config_path())
    optim = cfg.rl.optim.model_copy(update={"warmup_steps": 0})
    with tempfile.TemporaryDirectory() as tmp:
        corpus = [p.question + "\n" + p.solution_code for p in generate_problems(256, cfg.data.levels, seed=0)]
        model_dir = build_tiny_model(cfg.model.tiny, corpus, seed=0, out_dir=Path(tmp) / "model")
        deepspeed = Trainer(
            model_dir, optim, total_steps=args.steps + 1, threads=args.threads, zero_stage=args.zero_stage
        )
        plain = PlainTorch(model_dir, optim)
        batch = rl_batch(args.samples, args.length, deepspeed.engine.module.config.vocab_size, seed=0)
        times: dict[str, list[float]] = {"deepspeed": [], "torch": []}
        for step in range(args.steps + 1):  # step 0 warms both up and is not counted
            for name, trainer in (("deepspeed", deepspeed), ("torch", plain)):
                started = time.perf_counter()
                trainer.rl_step(batch, LossConfig())
                if step:
                    times[name].append(time.perf_counter() - started)
    ds, pt = statistics.median(times["deepspeed"]), statistics.median(times["torch"])
    params = sum(p.numel() for p in plain.model.parameters())
    print(
        f"model {params / 1e6:.2f}M params, batch {args.samples} x {args.length} tokens, "
        f"micro-batch {optim.micro_batch_size}, ZeRO-{args.zero_stage}, {args.threads} thread(s), {args.steps} steps"
    )
    print(f"plain torch AdamW : {pt:.3f} s/update (median)")
    print(f"DeepSpeed engine  : {ds:.3f} s/update (median)")
    print(f"ratio DeepSpeed / torch: {ds / pt:.2f}x (target <= 1.3x)")


if __name__ == "__main__":
    main()
