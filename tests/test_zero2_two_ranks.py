"""Two data-parallel ranks with ZeRO-2 on CPU (gloo over loopback): after RL updates on
different halves of a batch, both ranks hold identical parameters, equal to one process
updating on the whole batch (the token-mean is over the global batch).

Run: .venv/bin/python -m pytest tests/test_zero2_two_ranks.py -q   (about a minute)
"""

import os
import socket
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from tasks.config import LossConfig, OptimConfig, TinyModelConfig
from tasks.data.problems import generate_problems
from tasks.train.sample import Sample
from tasks.train.tiny_model import build_tiny_model
from tasks.train.trainer import Trainer

pytestmark = pytest.mark.slow  # starts engines or trains

OPTIM = OptimConfig(lr=1e-2, warmup_steps=0, zero_stage=2, micro_batch_size=2)
STEPS = 3


def batch(step: int) -> list[Sample]:
    """Eight samples of different lengths, so the two halves carry different token counts."""
    return [
        Sample(list(range(3 + i, 13 + 2 * i + step)), [0] * 3 + [1] * (7 + i + step), (-1.0) ** i) for i in range(8)
    ]


def half(step: int, rank: int) -> list[Sample]:
    return batch(step)[rank::2]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    cfg = TinyModelConfig(hidden_size=64, num_layers=2, num_heads=1, num_kv_heads=1, intermediate_size=128)
    corpus = [p.question for p in generate_problems(32, [1], seed=0)]
    return build_tiny_model(cfg, corpus, seed=0, out_dir=tmp_path_factory.mktemp("model"))


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_two_ranks_agree_with_each_other_and_with_one_process(model_dir, tmp_path):
    script = tmp_path / "rank.py"
    script.write_text(
        textwrap.dedent(f"""
        import torch
        from pathlib import Path
        from tasks.config import LossConfig
        from tasks.train.trainer import Trainer
        from tests.test_zero2_two_ranks import OPTIM, STEPS, half
        trainer = Trainer(Path({str(model_dir)!r}), OPTIM, total_steps=STEPS)
        rank = torch.distributed.get_rank()
        for step in range(STEPS):
            trainer.rl_step(half(step, rank), LossConfig())
        torch.save(dict(trainer.named_weights()), Path({str(tmp_path)!r}) / f"rank{{rank}}.pt")
    """)
    )
    root = Path(__file__).resolve().parent.parent
    env = {**os.environ, "PYTHONPATH": str(root), "OMP_NUM_THREADS": "1"}
    for key in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(key, None)  # torchrun sets its own
    launched = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nproc_per_node",
            "2",
            "--master_addr",
            "127.0.0.1",
            "--master_port",
            str(_free_port()),
            str(script),
        ],
        cwd=root,
        env=env,
        capture_output=True,
        text=True,
        timeout=400,
    )
    assert launched.returncode == 0, launched.stderr[-3000:]
    rank0, rank1 = (torch.load(tmp_path / f"rank{r}.pt") for r in (0, 1))
    assert rank0.keys() == rank1.keys()
    assert all(torch.equal(rank0[name], rank1[name]) for name in rank0)

    single = Trainer(model_dir, OPTIM, total_steps=STEPS)
    initial = {name: tensor.clone() for name, tensor in single.named_weights()}
    for step in range(STEPS):
        single.rl_step(half(step, 0) + half(step, 1), LossConfig())
    # Summation order differs between the two layouts, and Adam divides by sqrt(v), which
    # magnifies float noise on near-zero gradients (biases): compare against the size of the
    # update itself. A wrong normalisation (a mean of per-rank token-means) moves whole tensors.
    for name, tensor in single.named_weights():
        update = (tensor - initial[name]).abs().max().item()
        assert (rank0[name] - tensor).abs().max().item() <= 0.01 * update + 1e-7, name
