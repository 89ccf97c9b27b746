"""`rstar2 plan`'s trainer memory against the measured peak of a real RL step on CPU.

Each case runs in a fresh process: a Qwen3 model of the given shape, one DeepSpeed rank (ZeRO-2,
float32), one `Trainer.rl_step` on a micro-batch of random tokens. Measured: the process's peak
resident memory over its resident memory before the model existed. Estimated: the plan's model
states + activations + logits (tasks/cluster/memory.py) for the same shape and tokens. Prints
both and their ratio (target: within 20%, 0.8 to 1.2).

    .venv/bin/python bench/memory_bench.py
"""

from __future__ import annotations

import json
import os
import resource
import subprocess
import sys
import tempfile
from pathlib import Path

GIB = 2**30
CASES = {  # name: (config.json fields, micro-batch size, sequence length)
    "tiny default (3.4M)": (dict(vocab_size=2048, hidden_size=256, intermediate_size=512, num_hidden_layers=4,
                                 num_attention_heads=4, num_key_value_heads=2), 8, 512),
    "~100M": (dict(vocab_size=8192, hidden_size=768, intermediate_size=2048, num_hidden_layers=12,
                   num_attention_heads=12, num_key_value_heads=12), 2, 1024),
}  # fmt: skip


def _resident() -> int:
    return int(Path("/proc/self/statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def measure(fields: dict, micro_batch: int, length: int, checkpointing: bool) -> float:
    """Run in a child: GiB of peak resident memory one RL step adds to the process."""
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from tasks.config import LossConfig, OptimConfig
    from tasks.records import Sample
    from tasks.train.trainer import Trainer, init_distributed

    init_distributed()
    import deepspeed  # noqa: F401  (imported before the baseline: its code is not the trainer's memory)

    directory = Path(tempfile.mkdtemp(prefix="memory-bench-"))
    torch.manual_seed(0)
    config = Qwen3Config(**fields, head_dim=fields["hidden_size"] // fields["num_attention_heads"],
                         tie_word_embeddings=False, pad_token_id=0)  # fmt: skip
    Qwen3ForCausalLM(config).save_pretrained(directory)
    baseline = _resident()
    optim = OptimConfig(lr=1e-4, warmup_steps=0, micro_batch_size=micro_batch)
    trainer = Trainer(directory, optim, 10, zero_stage=2, gradient_checkpointing=checkpointing)
    gen = torch.Generator().manual_seed(0)
    samples = [
        Sample(torch.randint(1, fields["vocab_size"], (length,), generator=gen).tolist(), [0] * 8 + [1] * (length - 8),
               1.0 if i % 2 else -1.0)
        for i in range(micro_batch)
    ]  # fmt: skip
    trainer.rl_step(samples, LossConfig())
    return (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - baseline) / GIB


def estimate(fields: dict, micro_batch: int, length: int, checkpointing: bool) -> dict[str, float]:
    from tasks.cluster.memory import ModelShape, activation_memory, trainer_memory

    shape = ModelShape(fields, "bench")
    states = trainer_memory(shape.params, "float32", 2, 1)
    return states | activation_memory(shape, micro_batch * length, "float32", checkpointing)


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        print(json.dumps(measure(*json.loads(sys.argv[2]))))
        return
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    rows = []
    for name, (fields, micro_batch, length) in CASES.items():
        for checkpointing in (False, True):
            args = json.dumps([fields, micro_batch, length, checkpointing])
            out = subprocess.run([sys.executable, __file__, "--child", args], env=env, capture_output=True, text=True)
            if out.returncode:
                raise SystemExit(f"{name}: the measuring process failed:\n{out.stderr[-2000:]}")
            measured = json.loads(out.stdout.strip().splitlines()[-1])
            parts = estimate(fields, micro_batch, length, checkpointing)
            total = sum(parts.values())
            rows.append((name, checkpointing, micro_batch * length, parts, total, measured))
            print(f"{name:20s} checkpointing {'on ' if checkpointing else 'off'} {micro_batch * length:5d} tokens: "
                  f"plan {total:.3f} GiB (states {parts['weights'] + parts['grads'] + parts['optimizer']:.3f}, "
                  f"activations {parts['activations']:.3f}, logits {parts['logits']:.3f}), "
                  f"measured {measured:.3f} GiB, ratio {total / measured:.2f}", flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
