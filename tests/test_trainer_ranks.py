"""The trainer as Ray rank actors (tasks/cluster/trainers.py), with a real local Ray and real
DeepSpeed on CPU (gloo): two ranks on unequal shares of one global batch hold identical weights
after every step, equal to one rank trained on the whole batch; a two-rank checkpoint resumes in
new actors exactly where the old ones would have gone on, and a ZeRO-3 one on another number of
ranks within the same bound.

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
from tasks.store.run_folder import universal_copy
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


def test_a_zero3_checkpoint_resumes_on_another_number_of_ranks_with_its_optimizer_state(
    tiny_model, pair, solo, tmp_path
):
    """ZeRO-3, whose weights are partitioned too: saved by 2 ranks, resumed by 1, saved again and
    resumed by 2, each time through DeepSpeed's universal format. Each resumed step gives the
    weights the unbroken run has after that step, within the bound of two ranks against one; the
    same weights with a fresh optimizer and lr schedule take another step (the ZeRO state came
    across). Through the run's lifecycle object, a 2-rank run resumes on 1 rank in
    tests/test_resume_pipeline.py."""
    checkpoints, loss, optim = tmp_path / "checkpoints", LossConfig(), {"warmup_steps": 3, **LINEAR}

    def resumed_within_bound(resumed: dict, unbroken: dict, before: dict) -> float:
        # One step from the same weights and optimizer state: the reduction bound of the update.
        bound = 2 * U * max_abs(unbroken) + REDUCTION_BOUND * max_diff(unbroken, before)
        diff = max_diff(resumed, unbroken)
        assert diff < bound, f"resumed vs unbroken: {diff} (bound {bound})"
        return bound

    two = trainers(pair, tiny_model, 3, **optim)  # the lr rises each step of the warm-up
    lr_1 = two.rl_step(batch(0), loss)["lr"]
    two.save_checkpoint(checkpoints, "step-00001")
    at_1 = two.parameters()[0]
    expected_2 = two.rl_step(batch(1), loss)
    after_2 = two.parameters()[0]

    one = trainers(solo, tiny_model, 3, **optim)
    one.load_checkpoint(checkpoints, "step-00001")
    assert max_diff(one.parameters()[0], at_1) == 0.0  # a copy through the universal format
    assert one.rl_step(batch(1), loss)["lr"] == expected_2["lr"]
    resumed_2 = one.parameters()[0]
    resumed_within_bound(resumed_2, after_2, at_1)
    one.save_checkpoint(checkpoints, "step-00002")
    expected_3 = one.rl_step(batch(2), loss)
    after_3 = one.parameters()[0]

    two = trainers(pair, tiny_model, 3, **optim)  # fresh trainers in the same actors
    two.load_checkpoint(checkpoints, "step-00002")
    assert two.rl_step(batch(2), loss)["lr"] == expected_3["lr"]
    rank0, rank1 = two.parameters()
    assert all(torch.equal(rank0[name], rank1[name]) for name in rank0)
    bound = resumed_within_bound(rank0, after_3, resumed_2)
    assert universal_copy(checkpoints, "step-00001").is_dir() and universal_copy(checkpoints, "step-00002").is_dir()

    fresh = trainers(pair, tiny_model, 3, **optim)
    fresh.load_checkpoint(checkpoints, "step-00002", weights_only=True)
    assert max_diff(fresh.parameters()[0], resumed_2) == 0.0
    assert fresh.rl_step(batch(2), loss)["lr"] == pytest.approx(lr_1)  # the warm-up starts over
    diff = max_diff(fresh.parameters()[0], after_3)
    print(f"ZeRO-3 resumed 2 -> 1 -> 2 ranks within {bound:.1e}; a fresh optimizer differs by {diff:.1e}")
    assert diff > 100 * bound, diff
