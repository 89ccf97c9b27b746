"""The trainer as Ray rank actors (tasks/cluster/trainers.py), with a real local Ray and real
DeepSpeed on CPU (gloo): two ranks on unequal shares of one global batch hold identical weights
after every step, equal to one rank trained on the whole batch, and a two-rank checkpoint
resumes in new actors exactly where the old ones would have gone on.

Run: .venv/bin/python -m pytest tests/test_trainer_ranks.py -q   (about 40-50 s)
"""

import os
from contextlib import contextmanager
from pathlib import Path

import pytest
import ray
import torch

from tasks.cluster.connect import RayCluster
from tasks.cluster.trainers import TrainerActor, TrainerGroup
from tasks.config import LossConfig, OptimConfig, TinyModelConfig, TrainerConfig
from tasks.config.cluster import ClusterConfig
from tasks.data.problems import generate_problems
from tasks.records import Sample
from tasks.train.tiny_model import build_tiny_model
from tests.processes import wait_gone

pytestmark = pytest.mark.slow  # starts Ray actors and trains

LR = 1e-2
# Global batches of 7, 5 and 1 samples dealt to two ranks in micro-batches of 2: 4 + 3 samples
# in 2 + 2 micro-batches; 3 + 2 samples in 2 + 1 (rank 1 adds an empty one); 1 + 0 samples
# (rank 1 has none at all). One rank on the whole batch takes 4, 3 and 1 micro-batches.
SIZES = (7, 5, 1)


def batch(step: int) -> list[Sample]:
    """Samples of different lengths (so the shares hold different token counts), mixed signs."""
    return [
        Sample(list(range(3 + i, 12 + 3 * i + step)), [0] * 3 + [1] * (6 + 2 * i + step), (-1.0) ** (i + step) / 2)
        for i in range(SIZES[step % len(SIZES)])
    ]


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory) -> Path:
    cfg = TinyModelConfig(hidden_size=64, num_layers=2, num_heads=1, num_kv_heads=1, intermediate_size=128)
    corpus = [p.question for p in generate_problems(32, [1], seed=0)]
    return build_tiny_model(cfg, corpus, seed=0, out_dir=tmp_path_factory.mktemp("model"))


@pytest.fixture(scope="module")
def cluster():
    # Logical CPUs for five rank actors at once (the pair, the solo rank, the resumed pair).
    cluster = RayCluster(ClusterConfig(num_cpus=5)).start()
    yield cluster
    cluster.stop()


@contextmanager
def rank_actors(world: int):
    """`world` new rank actors, one process each; killed at the end, and their processes gone."""
    actors = [ray.remote(TrainerActor).options(num_cpus=1).remote(rank, world) for rank in range(world)]
    pids = [where["pid"] for where in ray.get([a.where.remote() for a in actors], timeout=120)]
    assert len(set(pids)) == world and os.getpid() not in pids
    try:
        yield actors
    finally:
        TrainerGroup(actors, timeout_s=300).stop()
        assert wait_gone(pids) == [], f"rank actors still running: {pids}"


# The actors outlive a test: each test starts fresh trainers in them (TrainerGroup.start).
@pytest.fixture(scope="module")
def pair(cluster):
    with rank_actors(2) as actors:
        yield actors


@pytest.fixture(scope="module")
def solo(cluster):
    with rank_actors(1) as actors:
        yield actors


def trainers(actors: list, model_dir: Path, zero_stage: int, warmup_steps: int = 0, **optim) -> TrainerGroup:
    optim = OptimConfig(lr=LR, warmup_steps=warmup_steps, micro_batch_size=2, **optim)
    role = TrainerConfig(ranks=len(actors), zero_stage=zero_stage)
    return TrainerGroup(actors, timeout_s=300).start(model_dir, optim, 10, "float32", seed=0, role=role)


def max_diff(a: dict, b: dict) -> float:
    assert a.keys() == b.keys()
    return max((a[name] - b[name]).abs().max().item() for name in a)


def max_abs(weights: dict) -> float:
    return max(tensor.abs().max().item() for tensor in weights.values())


# float32's unit roundoff. Two ranks and one sum the same per-token gradients in another order:
# each gradient element is a sum over at most 175 tokens of terms that went through 2 layers of
# 64-128-wide dot products, ~1e4 additions on its longest path, so the two gradients differ by at
# most ~1e4 u = 6e-4 of the largest (the worst case; measured: equal to the last bit or one ulp).
U = 2.0**-24
REDUCTION_BOUND = 1e4 * U
# AdamW with eps far above every gradient element (clipped to a norm <= 1): the update is about
# lr * g / eps, linear in g, so a gradient's float error moves its weight by at most lr / eps times
# it. With the default eps (1e-8) the first steps move every weight by about +-lr whatever the size
# of its gradient, so float noise on a near-zero gradient became a +-lr difference (1e-4 on an AVX2
# CPU, 2e-5 on an AVX-512 one).
LINEAR = {"eps": 1.0}


@pytest.mark.parametrize("zero_stage", [1, 2])
def test_two_ranks_equal_one_rank_on_the_whole_batch(tiny_model, pair, solo, zero_stage):
    two, one = trainers(pair, tiny_model, zero_stage, **LINEAR), trainers(solo, tiny_model, zero_stage, **LINEAR)
    start = one.parameters()[0]
    for step in range(len(SIZES)):
        shares = two.shares(batch(step))
        assert len(shares[0]) != len(shares[1])  # unequal sample counts ...
        tokens = [sum(sum(sample.loss_mask) for sample in share) for share in shares]  # mask[0] is 0
        assert tokens[0] != tokens[1]  # ... and token counts

        before = one.parameters()[0]
        got, expected = two.rl_step(batch(step), LossConfig()), one.rl_step(batch(step), LossConfig())
        rank0, rank1 = two.parameters()
        assert all(torch.equal(rank0[name], rank1[name]) for name in rank0), f"ranks differ after step {step}"
        after = one.parameters()[0]
        # Each side rounds every weight to float32 once a step (<= u |w| each), and their
        # gradients differ by the reduction bound of the largest update so far.
        update, moved = max_diff(after, before), max_diff(after, start)
        bound = 2 * (step + 1) * U * max_abs(after) + REDUCTION_BOUND * moved
        diff = max_diff(rank0, after)
        print(f"step {step}: two ranks vs one {diff:.2e}, bound {bound:.2e}, largest update {update:.2e}")
        assert diff < bound, f"two ranks vs one after step {step}: {diff} (bound {bound}, update {update})"
        assert got["tokens"] == expected["tokens"] == sum(tokens)
        # Sums over <= 175 tokens in another order: <= 175 u = 1e-5 relative.
        assert got["loss"] == pytest.approx(expected["loss"], rel=175 * U, abs=175 * U)
        assert got["entropy"] == pytest.approx(expected["entropy"], rel=175 * U)
        assert got["grad_norm"] == pytest.approx(expected["grad_norm"], rel=REDUCTION_BOUND)
        assert got.get("rank_weight_spread", 0.0) == 0.0


def test_two_rank_checkpoint_resumes_in_new_actors(tiny_model, pair, tmp_path):
    checkpoints, loss = tmp_path / "checkpoints", LossConfig()
    uninterrupted = trainers(pair, tiny_model, zero_stage=2, warmup_steps=3)  # the lr rises each step
    for step in range(2):
        uninterrupted.rl_step(batch(step), loss)
    saved = uninterrupted.parameters()[0]
    uninterrupted.save_checkpoint(checkpoints, "step-1", {"step": 1})
    # Every rank wrote its own optimizer partition.
    assert len(list((checkpoints / "step-1").glob("zero_pp_rank_*_optim_states.pt"))) == 2
    expected = uninterrupted.rl_step(batch(2), loss)
    final = uninterrupted.parameters()

    with rank_actors(2) as actors:
        resumed = trainers(actors, tiny_model, zero_stage=2, warmup_steps=3)
        assert resumed.load_checkpoint(checkpoints, "step-1")["step"] == 1
        assert all(torch.equal(p[name], saved[name]) for p in resumed.parameters() for name in saved)
        got = resumed.rl_step(batch(2), loss)
        assert (got["loss"], got["grad_norm"], got["lr"]) == (expected["loss"], expected["grad_norm"], expected["lr"])
        for rank, (after, before) in enumerate(zip(resumed.parameters(), final)):
            assert all(torch.equal(after[name], before[name]) for name in before), f"rank {rank}"

    # The optimizer state mattered: the same weights with a fresh AdamW and lr schedule (restarted
    # trainers in the first pair of actors) take another step.
    weights_only = trainers(pair, tiny_model, zero_stage=2, warmup_steps=3)
    weights_only.load_checkpoint(checkpoints, "step-1", weights_only=True)
    assert all(torch.equal(p[name], saved[name]) for p in weights_only.parameters() for name in saved)
    assert weights_only.rl_step(batch(2), loss)["lr"] < expected["lr"]
    diff = max_diff(weights_only.parameters()[0], final[0])
    assert diff > LR / 10, diff  # measured: 0.008
