"""The DeepSpeed trainer (CPU accelerator): one optimizer step per call whatever the number of
micro-batches, and a policy-gradient step moves log-probs in the advantage's direction.

Run: .venv/bin/python -m pytest tests/test_trainer.py -q   (about 30 s)
"""

import math

import pytest
import torch

from tasks.config import LossConfig, OptimConfig, TinyModelConfig
from tasks.data.problems import generate_problems
from tasks.records import Sample
from tasks.train.tiny_model import build_tiny_model
from tasks.train.trainer import Trainer, by_length, lr_multiplier


@pytest.fixture(scope="module")
def trainer(tmp_path_factory):
    problems = generate_problems(32, [1], seed=0)
    cfg = TinyModelConfig(hidden_size=64, num_layers=2, num_heads=1, num_kv_heads=1, intermediate_size=128)
    model_dir = build_tiny_model(cfg, [p.question for p in problems], seed=0, out_dir=tmp_path_factory.mktemp("m"))
    optim = OptimConfig(lr=1e-2, warmup_steps=0, micro_batch_size=2)
    return Trainer(model_dir, optim, total_steps=10)


def _samples(advantages):
    return [Sample(list(range(3, 3 + 12 + i)), [0] * 4 + [1] * (8 + i), a) for i, a in enumerate(advantages)]


@pytest.mark.slow
def test_one_optimizer_step_per_call(trainer):
    before = trainer.engine.global_steps
    trainer.rl_step(_samples([1.0, -1.0, 1.0, -1.0, 0.5]), LossConfig())  # 3 micro-batches
    trainer.rl_step(_samples([1.0, -1.0]), LossConfig())  # 1 micro-batch
    assert trainer.engine.global_steps == before + 2


@pytest.mark.slow
def test_positive_advantage_raises_log_probs_negative_lowers(trainer):
    up, down = _samples([1.0])[0], Sample(list(range(20, 32)), [0] * 4 + [1] * 8, -1.0)
    before = trainer.token_logprobs([up, down])
    metrics = trainer.rl_step([up, down], LossConfig())
    after = trainer.token_logprobs([up, down])
    assert sum(after[0][3:]) > sum(before[0][3:]) and sum(after[1][3:]) < sum(before[1][3:])
    assert metrics["tokens"] == 16 and metrics["grad_norm"] > 0 and metrics["entropy"] > 0


@pytest.mark.slow
def test_log_probs_are_those_of_the_sampling_temperature(trainer):
    samples = _samples([0.0, 0.0])  # no advantage: the policy does not move between the calls
    hot, cold = (trainer.rl_step(samples, LossConfig(), temperature=t)["entropy"] for t in (2.0, 0.5))
    assert hot > trainer.rl_step(samples, LossConfig())["entropy"] > cold


def test_micro_batches_group_samples_of_similar_length():
    samples = [Sample([1] * n, [1] * n, 0.0) for n in (140, 520, 150, 210, 500, 145)]
    ordered = by_length(samples)
    assert [len(s.token_ids) for s in ordered] == [520, 500, 210, 150, 145, 140]
    assert sorted(map(id, ordered)) == sorted(map(id, samples))  # nothing lost or repeated


@pytest.mark.slow
def test_update_does_not_depend_on_the_micro_batch_size(trainer, tmp_path):
    """Samples of mixed lengths in one micro-batch or in four, and the output layer's log-probs in
    chunks of 7 positions under ZeRO-3 (recomputed in backward, its weights gathered by DeepSpeed's
    hooks): the same loss, entropy and gradient."""
    model_dir = trainer.save_pretrained(tmp_path / "start")
    samples = [
        Sample(list(range(3, 3 + n)), [0] * 4 + [1] * (n - 4), a)
        for n, a in ((30, 1.0), (9, -1.0), (21, 0.5), (12, -0.5), (27, 1.0), (8, -1.0), (16, 1.0))
    ]
    metrics = [
        Trainer(
            model_dir,
            OptimConfig(lr=1e-2, warmup_steps=0, micro_batch_size=size),
            total_steps=2,
            zero_stage=stage,
            logit_chunk_tokens=chunk,
        ).rl_step(samples, LossConfig(), temperature=0.6)
        for size, stage, chunk in ((2, 1, None), (8, 1, None), (8, 3, 7))
    ]
    # float32, before Adam: the loss is -sum(A) / tokens at ratio exp(0) = 1 (exact sums, a few roundings);
    # entropy and grad_norm re-sum 95 tokens in 4 micro-batches vs 1 (134 vs 210 padded rows): ~sqrt(210) u = 1e-6;
    # chunks re-sum the output layer's gradient over 210 positions in 30 groups: the same order of rounding
    for other in metrics[1:]:
        for key in ("loss", "entropy", "grad_norm", "tokens"):
            assert metrics[0][key] == pytest.approx(other[key], rel=1e-5), key


def test_lr_schedule_warms_up_from_the_first_step():
    optim = OptimConfig(lr=1.0, warmup_steps=3, schedule="cosine")
    values = [lr_multiplier(step, optim, total_steps=13) for step in range(14)]
    assert values[:3] == [0.25, 0.5, 0.75] and values[3] == 1.0
    assert values[-1] == pytest.approx(0.1) and all(a >= b for a, b in zip(values[3:], values[4:]))


@pytest.mark.parametrize("zero_stage, dtype", [(3, "float32"), (1, "bfloat16")])
@pytest.mark.slow
def test_zero3_and_bf16_update_and_export_full_weights(trainer, zero_stage, dtype, tmp_path):
    model_dir = tmp_path / "start"
    trainer.save_pretrained(model_dir)
    other = Trainer(
        model_dir,
        OptimConfig(lr=1e-2, warmup_steps=0, micro_batch_size=2),
        total_steps=3,
        dtype=dtype,
        zero_stage=zero_stage,
    )
    before = {name: tensor.float().clone() for name, tensor in other.named_weights()}
    metrics = other.rl_step(_samples([1.0, -1.0, 1.0]), LossConfig())
    after = dict(other.named_weights())
    assert math.isfinite(metrics["loss"]) and after.keys() == before.keys()
    assert all(after[name].shape == before[name].shape for name in before)  # gathered, not partitioned
    assert any(not torch.equal(after[name].float(), before[name]) for name in before)


@pytest.mark.slow
def test_gradient_checkpointing_gives_the_same_update(trainer, tmp_path):
    model_dir = trainer.save_pretrained(tmp_path / "policy")
    optim = OptimConfig(lr=1e-2, warmup_steps=0, micro_batch_size=2)
    samples = _samples([1.0, -1.0, 0.5])
    after = []
    for checkpointing, chunk in ((False, None), (True, None), (True, 16)):
        fresh = Trainer(
            model_dir, optim, total_steps=10, gradient_checkpointing=checkpointing, logit_chunk_tokens=chunk
        )
        fresh.rl_step(samples, LossConfig())
        after.append(dict(fresh.named_weights()))
    # Exact: the recompute runs the same kernels on the same shapes, so the gradients (and Adam's step) are equal bits
    assert max((after[0][name] - after[1][name]).abs().max().item() for name in after[0]) < 1e-6
    # The logits in chunks of 16 positions too (recomputed beside the layers): the same update. The
    # output layer's gradient sums its chunks in another order (~1e-7 apart), which Adam's first step,
    # dividing by |g|, leaves at its size where g is not near zero; a near-zero g can flip its step's
    # sign, so the bound is two steps of lr: what a dropped or doubled chunk would exceed elsewhere.
    gaps = [(after[0][name] - after[2][name]).abs().max().item() for name in after[0]]
    print("chunked vs whole, max and median weight gap:", max(gaps), sorted(gaps)[len(gaps) // 2])
    assert max(gaps) <= 2 * optim.lr and sorted(gaps)[len(gaps) // 2] < 1e-6


@pytest.mark.slow
def test_importance_weights_read_the_samples_behaviour_log_probs(trainer, tmp_path):
    """rl.loss.is_cap on: samples drawn by the update's own policy train as without it (every
    weight 1); drawn by another one (its log-probs 0.5 lower: weights e^0.5, capped at 1.5) each
    token's loss counts 1.5 times, and the metrics say how many weights the cap truncated; with
    is_mode mask those tokens leave the loss."""
    model_dir = trainer.save_pretrained(tmp_path / "policy")
    optim = OptimConfig(lr=1e-2, warmup_steps=0, micro_batch_size=2)
    plain = _samples([1.0, -1.0, 0.5])
    own = Trainer(model_dir, optim, total_steps=10).token_logprobs(plain)

    def with_behaviour(shift: float) -> list[Sample]:
        return [
            Sample(s.token_ids, s.loss_mask, s.advantage, [0.0] + [lp - shift for lp in view])
            for s, view in zip(plain, own)
        ]

    after, metrics = [], []
    for samples, loss in ((plain, LossConfig()), (with_behaviour(0.0), LossConfig(is_cap=1.5)),
                          (with_behaviour(0.5), LossConfig(is_cap=1.5)),
                          (with_behaviour(0.5), LossConfig(is_cap=1.5, is_mode="mask"))):  # fmt: skip
        fresh = Trainer(model_dir, optim, total_steps=10)
        metrics.append(fresh.rl_step(samples, loss))
        after.append(dict(fresh.named_weights()))
    gap = lambda a, b: max((a[n] - b[n]).abs().max().item() for n in a)  # noqa: E731
    assert "is_weight_mean" not in metrics[0]
    # The weights are exp(update pass - eval pass log-probs), the passes padding the samples to other widths: 1
    # exactly where those shapes give the same bits, else 1 +- ~1e-6 (float32 logits through 64/128-term sums).
    assert metrics[1]["is_weight_mean"] == pytest.approx(1.0, abs=1e-4) and metrics[1]["is_truncated_frac"] == 0
    # Holds only with weights of exactly 1 (the same arithmetic on both sides): AdamW's first step turns a 1e-7
    # weight error on near-zero gradients into gaps of ~2e-4 (measured with plain torch).
    assert gap(after[0], after[1]) < 1e-6
    assert metrics[2]["is_weight_mean"] == pytest.approx(1.5) and metrics[2]["is_truncated_frac"] == 1.0
    # Before Adam, at ratio 1: each token's loss is exactly -1.5 A (e^0.5 capped); only the roundings differ, ~1e-7
    assert metrics[2]["loss"] == pytest.approx(1.5 * metrics[0]["loss"], rel=1e-4)
    assert metrics[2]["is_log_ratio_mean"] == pytest.approx(0.5, abs=1e-4)  # log(pi_old / mu), reported per step
    # AReaL's mask: every weight is over the cap, so no token trains and the weights stay put.
    assert metrics[3]["is_weight_mean"] == 0 and metrics[3]["loss"] == 0 and metrics[3]["is_truncated_frac"] == 1
    assert gap(after[3], {n: t for n, t in Trainer(model_dir, optim, total_steps=10).named_weights()}) == 0
    # A sample whose log-probs do not cover its tokens is refused before any update, never padded.
    short = with_behaviour(0.0)
    short[1] = Sample(short[1].token_ids, short[1].loss_mask, 1.0, short[1].behaviour_logprobs[:-1])
    n = len(short[1].token_ids)
    with pytest.raises(ValueError, match=f"and sample 1 carries {n - 1} behaviour log-probs for {n} tokens"):
        fresh.rl_step(short, LossConfig(is_cap=1.5))


@pytest.mark.slow
def test_exact_match_is_what_greedy_decoding_reproduces_and_ends_a_phase_early(tmp_path):
    from tasks.train.supervised import train_steps

    cfg = TinyModelConfig(hidden_size=64, num_layers=2, num_heads=1, num_kv_heads=1, intermediate_size=128)
    model_dir = build_tiny_model(cfg, [p.question for p in generate_problems(32, [1], seed=0)], 0, tmp_path)
    optim = OptimConfig(lr=3e-3, schedule="constant", warmup_steps=0, micro_batch_size=4)
    trainer = Trainer(model_dir, optim, total_steps=100, zero_stage=1)

    sequence = Sample(list(range(3, 15)), [0] * 4 + [1] * 8)
    checks = []
    taken = train_steps(
        trainer, [sequence] * 4, 4, 100, 0, "t", lambda metrics, step: None, until=lambda s: checks.append(s) or True
    )
    assert taken == 25 and checks == [24]  # asked every 25 steps, stops when it says so
    assert trainer.exact_match([sequence]) == 1.0  # 25 steps learn one sequence by heart
    model = trainer.engine.module
    with torch.no_grad():
        out = model.generate(torch.tensor([sequence.token_ids[:4]]), max_new_tokens=8, do_sample=False)
    assert out[0].tolist() == sequence.token_ids
    wrong = Sample(sequence.token_ids[:4] + [40] * 8, [0] * 4 + [1] * 8)
    assert trainer.exact_match([sequence, wrong]) == 0.5
