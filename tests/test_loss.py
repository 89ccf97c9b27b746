"""Token-level PPO-clip loss and SFT loss (tasks/rl/loss.py) against plain-numpy float64 references.

Covers: ppo_clip_loss value, gradient and clip metrics on random inputs with masking, positive,
negative and zero advantages, and ratios below the low clip, above the high clip and beyond the
dual clip; micro-batches sharing num_tokens add up to the full batch; token_logprobs matches a
log_softmax reference; sft_loss matches cross-entropy.

Run: OMP_NUM_THREADS=1 python -m pytest tests/test_loss.py -q
"""

import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from tasks.rl.loss import head_logprobs, ppo_clip_loss, sft_loss, token_logprobs

EPS_LOW, EPS_HIGH, DUAL = 0.2, 0.28, 3.0


def make_inputs(seed: int = 0, B: int = 6, T: int = 9):
    """Random (logp, old_logp, advantages, mask) with ratios spread over [0.3, 6]."""
    rng = np.random.default_rng(seed)
    logp = -rng.uniform(0.05, 4.0, size=(B, T))
    log_ratio = rng.uniform(math.log(0.3), math.log(6.0), size=(B, T))
    old_logp = logp - log_ratio
    advantages = np.array([1.3, -0.7, 0.0, -2.1, 0.4, -1.0])[:B]
    mask = rng.random((B, T)) < 0.7
    mask[0, :] = True  # one full row, one empty row
    mask[4, :] = False
    return logp, old_logp, advantages, mask


def reference_loss_and_grad(logp, old_logp, advantages, mask, num_tokens=None, behaviour=None, cap=None, mode=None):
    """Elementwise float64 reference: loss, d loss / d logp, and clip counts; with `behaviour`
    (the log-probs of the policy that drew each token) each token weighted by w = pi_old / mu,
    min(w, cap) (mode truncate) or 0 over the cap (mode mask)."""
    B, T = logp.shape
    N = float(mask.sum()) if num_tokens is None else float(num_tokens)
    loss, grad = 0.0, np.zeros((B, T))
    low = high = dual = 0
    for b in range(B):
        A = advantages[b]
        for t in range(T):
            if not mask[b, t]:
                continue
            r = math.exp(logp[b, t] - old_logp[b, t])
            w = 1.0 if behaviour is None else math.exp(old_logp[b, t] - behaviour[b, t])
            if behaviour is not None:
                w = min(w, cap) if mode == "truncate" else (w if w <= cap else 0.0)
            clipped = min(max(r, 1 - EPS_LOW), 1 + EPS_HIGH)
            value = max(-r * A, -clipped * A)  # = -min(rA, clip(r)A)
            if A < 0:
                value = min(value, -DUAL * A)
            loss += w * value / N
            # the unclipped term r*A is the one in use (so the gradient flows) unless a clip binds
            low_binds = A < 0 and r < 1 - EPS_LOW
            high_binds = A > 0 and r > 1 + EPS_HIGH
            dual_binds = A < 0 and r > DUAL
            if not (low_binds or high_binds or dual_binds):
                grad[b, t] = -w * r * A / N  # d(-r A)/d logp = -r A; the weight is a constant
            low += low_binds
            high += high_binds
            dual += dual_binds
    return loss, grad, (low, high, dual)


def test_inputs_cover_every_regime():
    logp, old_logp, advantages, mask = make_inputs()
    r = np.exp(logp - old_logp)
    A = advantages[:, None] * np.ones_like(r)
    m = mask
    assert (m & (A > 0) & (r > 1 + EPS_HIGH)).any()
    assert (m & (A < 0) & (r < 1 - EPS_LOW)).any()
    assert (m & (A < 0) & (r > DUAL)).any()
    assert (m & (A < 0) & (r > 1 + EPS_HIGH) & (r < DUAL)).any()  # unclipped on the high side
    assert (m & (r > 1 - EPS_LOW) & (r < 1 + EPS_HIGH)).any()
    assert (~m).any()


# float64: u = 1.1e-16 x a 35-token sum ~ 1e-14, x100 spare. float32: inputs |logp| <= 6.5 rounded (6.5u = 4e-7)
# give ~2.5e-6 per token's r * w * A, plus a 35-term sum (34u = 2e-6 of sum |l|): ~1e-5 at worst.
@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("dtype,tol", [(torch.float64, 1e-12), (torch.float32, 1e-5)])
@pytest.mark.parametrize("mode", [None, "truncate", "mask"], ids=["on-policy", "is-truncate", "is-mask"])
def test_ppo_clip_loss_matches_reference(seed, dtype, tol, mode):
    """Weighted: tokens drawn by a behaviour policy mu with log(pi_old / mu) over [-1.5, 1.5], so
    weights from 0.22 to 4.5, some above the cap of 2 and some below its inverse."""
    logp_np, old_np, adv_np, mask_np = make_inputs(seed)
    log_ratio = np.random.default_rng(seed + 10).uniform(-1.5, 1.5, size=old_np.shape)
    behaviour_np = old_np - log_ratio
    weights = np.exp(old_np - behaviour_np)
    assert (mask_np & (weights > 2.0)).any() and (mask_np & (weights < 0.5)).any()
    logp = torch.tensor(logp_np, dtype=dtype, requires_grad=True)
    behaviour = torch.tensor(behaviour_np, dtype=dtype, requires_grad=True)
    loss, metrics = ppo_clip_loss(
        logp,
        torch.tensor(old_np, dtype=dtype),
        torch.tensor(adv_np, dtype=dtype),
        torch.tensor(mask_np),
        eps_low=EPS_LOW,
        eps_high=EPS_HIGH,
        dual_clip=DUAL,
        **({"behaviour_logp": behaviour, "is_cap": 2.0, "is_mode": mode} if mode else {}),
    )
    loss.backward()
    reference = {"behaviour": behaviour_np, "cap": 2.0, "mode": mode} if mode else {}
    ref_loss, ref_grad, (low, high, dual) = reference_loss_and_grad(logp_np, old_np, adv_np, mask_np, **reference)
    assert loss.item() == pytest.approx(ref_loss, rel=tol, abs=tol)
    np.testing.assert_allclose(logp.grad.double().numpy(), ref_grad, rtol=tol, atol=tol)
    assert behaviour.grad is None  # the weight is a constant
    n = mask_np.sum()
    assert metrics["clip_frac_low"] == pytest.approx(low / n)
    assert metrics["clip_frac_high"] == pytest.approx(high / n)
    assert metrics["dual_clip_frac"] == pytest.approx(dual / n)
    if mode:
        applied = np.minimum(weights, 2.0) if mode == "truncate" else np.where(weights > 2.0, 0.0, weights)
        assert metrics["is_weight_mean"] == pytest.approx(applied[mask_np].sum() / n, rel=tol)
        assert metrics["is_truncated_frac"] == pytest.approx((weights > 2.0)[mask_np].sum() / n)
        assert metrics["is_below_inverse_cap_frac"] == pytest.approx((weights < 0.5)[mask_np].sum() / n)
        assert metrics["is_log_ratio_mean"] == pytest.approx(log_ratio[mask_np].mean(), rel=tol, abs=tol)
        assert metrics["is_log_ratio_abs_mean"] == pytest.approx(np.abs(log_ratio)[mask_np].mean(), rel=tol)
    else:
        assert "is_weight_mean" not in metrics


def test_an_unknown_importance_sampling_mode_is_refused():
    logp_np, old_np, adv_np, mask_np = make_inputs(0)
    args = [torch.tensor(t) for t in (logp_np, old_np, adv_np, mask_np)]
    with pytest.raises(ValueError, match="is_mode 'clip'"):
        ppo_clip_loss(*args, behaviour_logp=args[1], is_mode="clip")


def test_a_behaviour_policy_equal_to_the_proximal_one_changes_nothing():
    logp_np, old_np, adv_np, mask_np = make_inputs(5)
    args = [torch.tensor(old_np), torch.tensor(adv_np), torch.tensor(mask_np)]
    plain, _ = ppo_clip_loss(torch.tensor(logp_np), *args)
    weighted, metrics = ppo_clip_loss(torch.tensor(logp_np), *args, behaviour_logp=torch.tensor(old_np))
    assert weighted.item() == pytest.approx(plain.item(), rel=1e-12)  # exp(0) = 1: the same sums, equal bits
    assert metrics["is_weight_mean"] == pytest.approx(1.0) and metrics["is_truncated_frac"] == 0.0


def test_dual_clip_bounds_negative_advantage_loss():
    # A = -1, ratio 10: PPO alone gives loss 10 per token; dual-clip caps it at 3 with no gradient.
    logp = torch.tensor([[math.log(10.0)]], dtype=torch.float64, requires_grad=True)
    old_logp, advantages = torch.zeros(1, 1, dtype=torch.float64), torch.tensor([-1.0], dtype=torch.float64)
    loss, metrics = ppo_clip_loss(logp, old_logp, advantages, torch.ones(1, 1))
    loss.backward()
    assert loss.item() == pytest.approx(3.0)
    assert logp.grad.item() == 0.0
    assert metrics["dual_clip_frac"] == 1.0


def test_negative_weight_scales_only_the_negative_rollouts_loss_and_gradient():
    logp_np, old_np, adv_np, mask_np = make_inputs(4)
    old, adv, mask = torch.tensor(old_np), torch.tensor(adv_np), torch.tensor(mask_np)
    negative = torch.tensor(adv_np < 0)[:, None]
    per_weight = {}
    for weight in (1.0, 0.25):
        logp = torch.tensor(logp_np, requires_grad=True)
        loss, metrics = ppo_clip_loss(logp, old, adv, mask, negative_weight=weight)
        loss.backward()
        per_weight[weight] = (loss.item(), logp.grad, metrics)
    (loss_1, grad_1, metrics_1), (loss_q, grad_q, metrics_q) = per_weight[1.0], per_weight[0.25]
    torch.testing.assert_close(grad_q, torch.where(negative, 0.25 * grad_1, grad_1))  # x 0.25 (2^-2) is exact
    assert (grad_1[negative.expand_as(grad_1)] != 0).any()  # the check above is not vacuous
    # the loss splits the same way: positive part + weight x negative part
    ref, _, _ = reference_loss_and_grad(
        logp_np, old_np, np.where(adv_np < 0, adv_np, 0.0), mask_np, num_tokens=int(mask_np.sum())
    )
    # float64: 35-term sums in two orders (~35u = 4e-15 of sum |l|), x ~7 for the cancellation in loss_1 - ref
    assert loss_q == pytest.approx((loss_1 - ref) + 0.25 * ref, rel=1e-10)
    assert metrics_q == metrics_1  # where a clip binds does not depend on the weight


def test_micro_batches_with_shared_num_tokens_add_up():
    logp_np, old_np, adv_np, mask_np = make_inputs(3)
    old, adv, mask = torch.tensor(old_np), torch.tensor(adv_np), torch.tensor(mask_np)
    full_logp = torch.tensor(logp_np, requires_grad=True)
    full_loss, _ = ppo_clip_loss(full_logp, old, adv, mask)
    full_loss.backward()

    num_tokens = int(mask.sum())
    split_logp = torch.tensor(logp_np, requires_grad=True)
    total = 0.0
    for rows in (slice(0, 2), slice(2, 5), slice(5, 6)):
        part, _ = ppo_clip_loss(split_logp[rows], old[rows], adv[rows], mask[rows], num_tokens=num_tokens)
        part.backward()  # gradients accumulate as in gradient accumulation
        total += part.item()
    assert total == pytest.approx(full_loss.item(), rel=1e-12)  # float64: 35 tokens in 3 sums vs 1, ~35u = 4e-15
    torch.testing.assert_close(split_logp.grad, full_logp.grad)  # per-token products, no sum: equal bits


def test_all_masked_is_zero_not_nan():
    logp = torch.zeros(2, 3, requires_grad=True)
    loss, metrics = ppo_clip_loss(logp, torch.zeros(2, 3), torch.tensor([1.0, -1.0]), torch.zeros(2, 3))
    loss.backward()
    assert loss.item() == 0.0 and torch.isfinite(logp.grad).all()
    assert metrics == {"clip_frac_low": 0.0, "clip_frac_high": 0.0, "dual_clip_frac": 0.0}


def test_token_logprobs_matches_log_softmax():
    torch.manual_seed(0)
    B, T, V = 3, 5, 11
    logits = torch.randn(B, T, V, dtype=torch.float64) * 3
    targets = torch.randint(0, V, (B, T))
    got = token_logprobs(logits, targets)
    assert got.shape == (B, T) and got.dtype == torch.float32
    logits_np = logits.numpy()
    for b in range(B):
        for t in range(T):
            row = logits_np[b, t]
            reference = row[targets[b, t]] - (row.max() + math.log(np.exp(row - row.max()).sum()))
            # float32: |logit| <= 9.4 and |logp| <= 10.5 rounded (6e-7 each) + an 11-term sum: ~2e-6 at worst
            assert got[b, t].item() == pytest.approx(reference, abs=1e-5)
    # bf16 logits are upcast; an ignore index (-1) does not crash, it is the mask's job
    targets[0, 0] = -1
    assert torch.isfinite(token_logprobs(logits.bfloat16(), targets)).all()


def test_sft_loss_is_masked_token_mean_cross_entropy():
    torch.manual_seed(1)
    B, T, V = 2, 6, 7
    logits = torch.randn(B, T, V)
    targets = torch.randint(0, V, (B, T))
    mask = torch.rand(B, T) < 0.6
    mask[0, 0] = True
    ignored = torch.where(mask, targets, torch.full_like(targets, -100))
    reference = F.cross_entropy(logits.reshape(-1, V), ignored.reshape(-1), ignore_index=-100)
    logp = token_logprobs(logits, targets)
    # float32, the same log-softmax per token on both sides: 8 positive terms summed in other orders
    # (7u a side, as for half + rest: 2u + 4u + 1u; / 8 is exact) differ by <= 14u = 8.4e-7
    assert sft_loss(logp, mask).item() == pytest.approx(reference.item(), rel=1e-6)
    # with a batch-wide count, a part's loss is its share of the sum
    half = sft_loss(logp[:1], mask[:1], num_tokens=int(mask.sum()))
    rest = sft_loss(logp[1:], mask[1:], num_tokens=int(mask.sum()))
    assert (half + rest).item() == pytest.approx(reference.item(), rel=1e-6)


def _head_step(dtype, chunk_tokens, seed=3, B=3, T=11, H=16, V=97):
    """Log-probs, entropy and the gradients of hidden states and output layer after a weighted sum
    of the log-probs (any loss reaches them only through that sum's weights)."""
    gen = torch.Generator().manual_seed(seed)
    head = torch.nn.Linear(H, V, bias=False).to(dtype)
    with torch.no_grad():
        head.weight.copy_(torch.randn(V, H, generator=gen) * 0.5)
    hidden = (torch.randn(B, T, H, generator=gen) * 2).to(dtype).requires_grad_()
    targets = torch.randint(0, V, (B, T), generator=gen)
    targets[0, 0] = -100  # an ignore index: read as token 0, removed by the caller's mask
    weights = torch.randn(B, T, generator=gen, dtype=torch.float64)
    logp, entropy = head_logprobs(head, hidden, targets, temperature=0.7, chunk_tokens=chunk_tokens)
    (logp.double() * weights).sum().backward()
    return logp, entropy, hidden.grad, head.weight.grad


@pytest.mark.parametrize("chunk_tokens", [1, 4, 10, 33])
def test_log_probs_in_chunks_have_the_unchunked_values_and_gradients(chunk_tokens):
    whole = _head_step(torch.float64, None)
    chunked = _head_step(torch.float64, chunk_tokens)
    # float64: the same operations per position; only the output layer's gradient sums its 33
    # positions' terms in another grouping: 33 terms of |x| <= ~10 at 1.1e-16 each, far below 1e-12
    for name, a, b in zip(("logp", "entropy", "hidden grad", "head grad"), whole, chunked):
        assert (a - b).abs().max().item() < 1e-12, name
    assert whole[3].abs().sum() > 0  # the gradient reached the output layer


def test_head_log_probs_are_the_tempered_log_softmax_and_its_entropy():
    gen = torch.Generator().manual_seed(0)
    head = torch.nn.Linear(8, 13, bias=False).double()
    hidden, targets = torch.randn(2, 5, 8, generator=gen, dtype=torch.float64), torch.randint(0, 13, (2, 5))
    logp, entropy = head_logprobs(head, hidden, targets, temperature=0.6, chunk_tokens=3)
    logits = head(hidden) / 0.6
    assert torch.allclose(logp, token_logprobs(logits, targets).double(), atol=1e-6)  # token_logprobs: float32
    p = torch.softmax(logits, -1)
    assert torch.allclose(entropy, -(p * p.log()).sum(-1), atol=1e-12)


def test_log_probs_in_chunks_match_in_bfloat16():
    whole, chunked = _head_step(torch.bfloat16, None), _head_step(torch.bfloat16, 5)
    # The log-softmax runs in float32 on bf16 logits that chunking does not change (a row's logits
    # are the same products), so log-probs and entropy agree to float32 rounding. The gradients
    # are bf16: the output layer's sums 33 positions' terms in another order, each rounding
    # within bf16's 2^-8 relative step.
    assert (whole[0] - chunked[0]).abs().max().item() < 1e-5
    assert (whole[1] - chunked[1]).abs().max().item() < 1e-5
    assert torch.equal(whole[2], chunked[2])
    scale = whole[3].float().abs().max().item()
    assert (whole[3].float() - chunked[3].float()).abs().max().item() <= 4 * 2**-8 * scale
