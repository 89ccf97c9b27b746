"""`rstar2 plan`'s trainer memory against the measured peak of a real RL step, and the output
layer's log-probs whole against in chunks (trainer.logit_chunk_tokens).

Each case runs in a fresh process: a Qwen3 model of the given shape, one DeepSpeed rank (ZeRO-2),
`Trainer.rl_step` on a micro-batch of random tokens. On CPU (float32): the process's peak resident
memory over its resident memory before the model existed, one step. On CUDA (bfloat16, three
steps): torch.cuda.max_memory_allocated over what was allocated before the trainer. Estimated: the
plan's terms (tasks/cluster/memory.py, the device's calibration) for the same shape and tokens.
Prints both, their ratio (target: within 15% on CUDA, 20% on CPU), the last step's seconds and its
gradient norm; `--chunks` runs the chunk cases and prints chunked against whole (target: the
logits term down at least 4x at 16K tokens, a step within 1.05x, the same gradient norm).

    .venv/bin/python bench/memory_bench.py [--device cuda] [--chunks]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

GIB = 2**30
QWEN3_06B = dict(vocab_size=151936, hidden_size=1024, intermediate_size=3072, num_hidden_layers=28,
                 num_attention_heads=16, num_key_value_heads=8, head_dim=128)  # fmt: skip
QWEN3_17B = QWEN3_06B | dict(hidden_size=2048, intermediate_size=6144)
TINY = dict(vocab_size=2048, hidden_size=256, intermediate_size=512, num_hidden_layers=4, num_attention_heads=4,
            num_key_value_heads=2)  # fmt: skip
M100 = dict(vocab_size=8192, hidden_size=768, intermediate_size=2048, num_hidden_layers=12, num_attention_heads=12,
            num_key_value_heads=12)  # fmt: skip
TWO_LAYERS = QWEN3_06B | dict(num_hidden_layers=2)
# name: (config.json fields, micro-batch size, sequence length, gradient checkpointing)
CASES = {
    "cpu": {
        "tiny default (3.4M), 8x512": (TINY, 8, 512, False),
        "tiny default (3.4M), 8x512, checkpointing": (TINY, 8, 512, True),
        "~100M, 2x1024": (M100, 2, 1024, False),
        "~100M, 2x1024, checkpointing": (M100, 2, 1024, True),
    },
    # The cases of the H200 table the plan's GPU terms are fitted to (docs/benchmarks.md).
    "cuda": {
        "0.6B 1x8192": (QWEN3_06B, 1, 8192, False),
        "0.6B 1x8192, checkpointing": (QWEN3_06B, 1, 8192, True),
        "0.6B 2x8192, checkpointing": (QWEN3_06B, 2, 8192, True),
        "1.7B 1x16384, checkpointing": (QWEN3_17B, 1, 16384, True),
        "1.7B 1x8192": (QWEN3_17B, 1, 8192, False),
        "states alone: 0.6B 1x256": (QWEN3_06B, 1, 256, False),
        "states alone: 1.7B 1x256": (QWEN3_17B, 1, 256, False),
        "logits alone: 2 layers 1x16384": (TWO_LAYERS, 1, 16384, False),
        "logits alone: 2 layers 1x32768": (TWO_LAYERS, 1, 32768, False),
    },
}
# The logits' share of a step: a wide vocabulary at 16K tokens, whole and in chunks.
CHUNK_CASES = {
    "cpu": {"2 layers, 32K vocabulary, 1x16384": (TWO_LAYERS | dict(vocab_size=32768, hidden_size=256,
                                                  intermediate_size=512, num_attention_heads=4, num_key_value_heads=2,
                                                  head_dim=64), 1, 16384, False)},
    "cuda": {name: CASES["cuda"][name] for name in ("logits alone: 2 layers 1x16384", "1.7B 1x16384, checkpointing")},
}  # fmt: skip
CHUNK = 2048


def _resident() -> int:
    return int(Path("/proc/self/statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def measure(device: str, fields: dict, micro_batch: int, length: int, checkpointing: bool, chunk: int | None):
    """Run in a child: (GiB one RL step adds at its peak, seconds of the last step, grad norm)."""
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from tasks.config import LossConfig, OptimConfig
    from tasks.records import Sample
    from tasks.train.distributed import init_distributed
    from tasks.train.trainer import Trainer

    init_distributed()
    import deepspeed  # noqa: F401  (imported before the baseline: its code is not the trainer's memory)

    directory = Path(tempfile.mkdtemp(prefix="memory-bench-"))
    torch.manual_seed(0)
    config = Qwen3Config(**({"head_dim": fields["hidden_size"] // fields["num_attention_heads"]} | fields),
                         tie_word_embeddings=False, pad_token_id=0)  # fmt: skip
    Qwen3ForCausalLM(config).save_pretrained(directory)
    cuda = device == "cuda"
    baseline = torch.cuda.memory_allocated() if cuda else _resident()
    optim = OptimConfig(lr=1e-4, warmup_steps=0, micro_batch_size=micro_batch)
    trainer = Trainer(directory, optim, 10, dtype="bfloat16" if cuda else "float32", zero_stage=2,
                      gradient_checkpointing=checkpointing, logit_chunk_tokens=chunk)  # fmt: skip
    gen = torch.Generator().manual_seed(0)
    samples = [
        Sample(torch.randint(1, fields["vocab_size"], (length,), generator=gen).tolist(), [0] * 8 + [1] * (length - 8),
               1.0 if i % 2 else -1.0)
        for i in range(micro_batch)
    ]  # fmt: skip
    for _ in range(3 if cuda else 1):
        if cuda:
            torch.cuda.synchronize()
        start = time.perf_counter()
        metrics = trainer.rl_step(samples, LossConfig())
        if cuda:
            torch.cuda.synchronize()
        seconds = time.perf_counter() - start
    peak = torch.cuda.max_memory_allocated() if cuda else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return (peak - baseline) / GIB, seconds, metrics["grad_norm"]


def estimate(device: str, fields: dict, micro_batch: int, length: int, checkpointing: bool, chunk: int | None):
    from tasks.cluster.memory import ModelShape, trainer_peak

    dtype = "bfloat16" if device == "cuda" else "float32"
    shape = ModelShape(fields, "bench")
    return trainer_peak(shape, dtype, 2, 1, micro_batch * length, checkpointing, chunk, device)


def run_case(device: str, case: tuple, chunk: int | None) -> dict:
    fields, micro_batch, length, checkpointing = case
    args = json.dumps([device, fields, micro_batch, length, checkpointing, chunk])
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    out = subprocess.run([sys.executable, __file__, "--child", args], env=env, capture_output=True, text=True)
    if out.returncode:
        raise SystemExit(f"{fields}: the measuring process failed:\n{out.stderr[-2000:]}")
    peak, seconds, grad_norm = json.loads(out.stdout.strip().splitlines()[-1])
    parts = estimate(device, fields, micro_batch, length, checkpointing, chunk)
    return {"parts": parts, "plan": sum(parts.values()), "peak": peak, "seconds": seconds, "grad_norm": grad_norm}


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        print(json.dumps(measure(*json.loads(sys.argv[2]))))
        return
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--chunks", action="store_true", help=f"whole logits against chunks of {CHUNK} positions")
    args = parser.parse_args()
    if args.chunks:
        for name, case in CHUNK_CASES[args.device].items():
            whole, chunked = (run_case(args.device, case, c) for c in (None, CHUNK))
            print(f"{name}: peak {whole['peak']:.2f} -> {chunked['peak']:.2f} GiB "
                  f"(logits term {whole['parts']['logits']:.2f} -> {chunked['parts']['logits']:.2f}, "
                  f"plan {whole['plan']:.2f} -> {chunked['plan']:.2f}), step {whole['seconds']:.2f} -> "
                  f"{chunked['seconds']:.2f} s ({chunked['seconds'] / whole['seconds']:.2f}x), grad norm "
                  f"{whole['grad_norm']:.6g} vs {chunked['grad_norm']:.6g} "
                  f"(relative gap {abs(whole['grad_norm'] - chunked['grad_norm']) / whole['grad_norm']:.1e})",
                  flush=True)  # fmt: skip
        return
    for name, case in CASES[args.device].items():
        row = run_case(args.device, case, None)
        parts = ", ".join(f"{k} {v:.3f}" for k, v in row["parts"].items())
        print(f"{name}: plan {row['plan']:.3f} GiB ({parts}), measured {row['peak']:.3f} GiB, "
              f"ratio {row['plan'] / row['peak']:.2f}, step {row['seconds']:.2f} s", flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
