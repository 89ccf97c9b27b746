"""Save at step k, SIGKILL the training process, resume in another: the next step's loss equals
an uninterrupted run's, to the last digit (weights, AdamW state, lr schedule all restored).

Run: .venv/bin/python -m pytest tests/test_resume.py -q   (about 40 s)
"""

import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from tasks.config import LossConfig, OptimConfig, TinyModelConfig
from tasks.data.problems import generate_problems
from tasks.records import Sample
from tasks.train.tiny_model import build_tiny_model
from tasks.train.trainer import Trainer

pytestmark = pytest.mark.slow  # starts engines or trains

OPTIM = OptimConfig(lr=5e-3, warmup_steps=2, micro_batch_size=2)  # at ZeRO-2, the default
STEPS_BEFORE_KILL = 3


def batches() -> list[list[Sample]]:
    """Deterministic RL batches, one per step, mixed lengths and signs of advantage."""
    return [
        [Sample(list(range(3 + step, 15 + step + i)), [0] * 4 + [1] * (8 + i), (-1.0) ** (i + step)) for i in range(5)]
        for step in range(STEPS_BEFORE_KILL + 1)
    ]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    cfg = TinyModelConfig(hidden_size=64, num_layers=2, num_heads=1, num_kv_heads=1, intermediate_size=128)
    corpus = [p.question for p in generate_problems(32, [1], seed=0)]
    return build_tiny_model(cfg, corpus, seed=0, out_dir=tmp_path_factory.mktemp("model"))


def test_resume_after_sigkill_matches_uninterrupted(model_dir, tmp_path):
    checkpoints = tmp_path / "checkpoints"
    # The interrupted run: a separate process trains k steps, checkpoints, and is SIGKILLed.
    script = textwrap.dedent(f"""
        import os, signal
        from pathlib import Path
        from tasks.config import LossConfig, OptimConfig
        from tasks.train.trainer import Trainer
        from tests.test_resume import OPTIM, STEPS_BEFORE_KILL, batches
        trainer = Trainer(Path({str(model_dir)!r}), OPTIM, total_steps=10)
        for step, batch in enumerate(batches()[:STEPS_BEFORE_KILL]):
            trainer.rl_step(batch, LossConfig())
            trainer.save_checkpoint(Path({str(checkpoints)!r}), tag=f"step-{{step}}", client_state={{"step": step}})
        os.kill(os.getpid(), signal.SIGKILL)
    """)
    root = Path(__file__).resolve().parent.parent
    # A fresh single-process group: not this process's (its port is taken).
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
    }
    killed = subprocess.run(
        [sys.executable, "-c", script],
        cwd=root,
        env={**env, "PYTHONPATH": str(root)},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-2000:]

    resumed = Trainer(model_dir, OPTIM, total_steps=10)
    assert resumed.load_checkpoint(checkpoints)["step"] == STEPS_BEFORE_KILL - 1  # the latest tag
    resumed_step = resumed.rl_step(batches()[STEPS_BEFORE_KILL], LossConfig())

    uninterrupted = Trainer(model_dir, OPTIM, total_steps=10)
    for batch in batches()[:STEPS_BEFORE_KILL]:
        uninterrupted.rl_step(batch, LossConfig())
    expected = uninterrupted.rl_step(batches()[STEPS_BEFORE_KILL], LossConfig())
    # The same arithmetic in the same order on one rank: equal bits. The loss alone is weight-blind
    # (at ratio exp(0) = 1 it is -sum(A) / tokens whatever the weights); the entropy, the gradient's
    # norm and the weights after the step are not.
    assert all(resumed_step[key] == expected[key] for key in ("loss", "entropy", "grad_norm"))
    after = dict(uninterrupted.named_weights())
    assert all(torch.equal(tensor, after[name]) for name, tensor in resumed.named_weights())
    assert resumed.engine.global_steps == uninterrupted.engine.global_steps == STEPS_BEFORE_KILL + 1
    assert resumed.engine.get_lr() == uninterrupted.engine.get_lr()


def test_missing_checkpoint_is_a_clear_error(model_dir, tmp_path):
    with pytest.raises(FileNotFoundError, match="no DeepSpeed checkpoint"):
        Trainer(model_dir, OPTIM, total_steps=10).load_checkpoint(tmp_path / "nothing-here")
