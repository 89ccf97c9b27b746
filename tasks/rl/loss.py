"""Token-level PPO-clip loss for GRPO-RoC, and the masked cross-entropy used by SFT.

The RL objective (rStar2-Agent, arXiv 2508.20722) departs from textbook GRPO in four ways:

1. no KL term and no entropy bonus;
2. clip-higher: the ratio is clipped to [1 - eps_low, 1 + eps_high] with eps_high > eps_low,
   so low-probability tokens with positive advantage can grow faster (keeps exploration up);
3. dual-clip for negative advantages: the loss of a token is capped at -dual_clip * A, so a
   token whose ratio exploded cannot dominate the batch;
4. token-mean: the sum over every kept response token divided by the number of such tokens in
   the whole batch, not a per-sequence mean (long rollouts are not down-weighted).

Tool-response tokens are removed by the mask, the same way as padding. Not from the paper:
`negative_weight` (default 1, the paper's loss) scales the tokens of negative-advantage rollouts,
and tokens drawn by another policy than the update's starting one (the engine's: stale weights,
or its own kernels) can be reweighted by importance sampling, as in decoupled PPO: the clipped
ratio is taken against the proximal policy (the trainer's weights as the update starts), and each
token is weighted by pi_prox / mu, mu the behaviour policy, truncated at is_cap (verl's TIS) or
masked out over it (AReaL).
"""

from collections.abc import Callable

import torch
from torch import Tensor
from torch.utils.checkpoint import checkpoint


def token_logprobs(logits: Tensor, targets: Tensor) -> Tensor:
    """log p(target) per position: log_softmax(logits)[b, t, targets[b, t]].

    logits (B, T, V), targets (B, T) -> (B, T) in float32 (bf16 log-probs are too coarse for
    ratios close to 1). Negative targets (an ignore index) are read as token 0: the value there
    is meaningless and the caller's mask must remove it.
    """
    return _gather(torch.log_softmax(logits.float(), dim=-1), targets)


def _gather(logp_all: Tensor, targets: Tensor) -> Tensor:
    """logp_all (..., V) at each target (...): an ignore index (negative) reads token 0."""
    return logp_all.gather(-1, targets.clamp(min=0).long().unsqueeze(-1)).squeeze(-1)


def _head_chunk(head: Callable[[Tensor], Tensor], hidden: Tensor, targets: Tensor, temperature: float):
    logits = head(hidden)
    # at least float32 (bf16 log-probs are too coarse for ratios close to 1)
    logits = logits.to(torch.promote_types(logits.dtype, torch.float32))
    logp_all = torch.log_softmax(logits / temperature, dim=-1)
    with torch.no_grad():
        entropy = -(logp_all.exp() * logp_all).sum(-1)
    return _gather(logp_all, targets), entropy


def head_logprobs(
    head: Callable[[Tensor], Tensor],
    hidden: Tensor,
    targets: Tensor,
    temperature: float = 1.0,
    chunk_tokens: int | None = None,
) -> tuple[Tensor, Tensor]:
    """log p(target) and the entropy (no gradient) per position, from the last hidden states.

    head maps hidden states (..., H) to logits (..., V): the model's output layer. hidden (B, T, H),
    targets (B, T) -> two (B, T) tensors of at least float32, as token_logprobs(head(hidden) / temperature).
    With chunk_tokens, the B*T positions go through the head that many at a time, each chunk
    recomputed in backward: the (tokens x vocab) logits, the largest tensor of a step at a 150K
    vocabulary, then never exist whole, in the forward pass or the backward. The gradient is the
    unchunked one; only the order of the output layer's weight-gradient sum changes.
    """
    flat_hidden, flat_targets = hidden.reshape(-1, hidden.shape[-1]), targets.reshape(-1)
    if chunk_tokens is None or flat_targets.numel() <= chunk_tokens:
        logp, entropy = _head_chunk(head, flat_hidden, flat_targets, temperature)
    else:
        parts = [
            checkpoint(_head_chunk, head, h, t, temperature, use_reentrant=False)
            for h, t in zip(flat_hidden.split(chunk_tokens), flat_targets.split(chunk_tokens))
        ]
        logp, entropy = (torch.cat(column) for column in zip(*parts))
    return logp.view(targets.shape), entropy.view(targets.shape)


def _normaliser(mask: Tensor, num_tokens: int | None) -> float:
    """Token-mean denominator: the batch-wide token count, at least 1 (an all-masked batch gives 0)."""
    count = int(mask.sum().item()) if num_tokens is None else int(num_tokens)
    return float(max(count, 1))


def ppo_clip_loss(
    logp: Tensor,
    old_logp: Tensor,
    advantages: Tensor,
    mask: Tensor,
    eps_low: float = 0.2,
    eps_high: float = 0.28,
    dual_clip: float = 3.0,
    num_tokens: int | None = None,
    negative_weight: float = 1.0,
    behaviour_logp: Tensor | None = None,
    is_cap: float = 2.0,
    is_mode: str = "truncate",
) -> tuple[Tensor, dict[str, float]]:
    """Token-level PPO-clip loss with clip-higher and dual-clip, token-mean normalised.

    With ratio r = exp(logp - old_logp) and A the advantage of the token's rollout:

        l     = -min(r * A, clip(r, 1 - eps_low, 1 + eps_high) * A)
        l     = min(l, -dual_clip * A)                     only when A < 0   (dual-clip)
        l     = negative_weight * l                        only when A < 0
        w     = exp(old_logp - behaviour_logp)                 only with behaviour_logp:
        l     = min(w, is_cap) * l                             is_mode truncate (verl's TIS)
        l     = (w if w <= is_cap else 0) * l                  is_mode mask (AReaL)
        loss  = sum_{masked tokens} l / num_tokens

    old_logp is then the proximal policy's and behaviour_logp the policy that drew the token;
    the weight is a constant (no gradient flows through it).

    For A < 0 the dual-clip bound -dual_clip * A = dual_clip * |A| > 0 binds once r > dual_clip,
    and the token then has zero gradient.

    num_tokens is the number of kept response tokens in the WHOLE batch (all micro-batches), so
    summing the losses of micro-batches (or accumulating their gradients) gives the full-batch
    loss; it defaults to mask.sum(), i.e. this call is the whole batch.

    Shapes: logp, old_logp, mask (B, T); advantages (B,) broadcast over tokens, or (B, T).
    Metrics (fractions of this call's masked tokens, where the clip is binding and so the
    gradient is zero): clip_frac_low (A < 0, r < 1 - eps_low), clip_frac_high (A > 0,
    r > 1 + eps_high), dual_clip_frac (A < 0, r > dual_clip); with behaviour_logp also
    is_weight_mean (the applied weights' mean), is_truncated_frac (weights over is_cap: truncated
    or masked), is_below_inverse_cap_frac (weights under 1 / is_cap), is_log_ratio_mean (the mean of
    log(pi_old / mu): how far the behaviour policy is from the update's start) and
    is_log_ratio_abs_mean (the mean engine/trainer log-prob gap).
    """
    mask = mask.bool()
    if advantages.dim() == 1:
        advantages = advantages.unsqueeze(-1)  # (B, 1), broadcasts over T
    advantages = advantages.to(logp.dtype)
    old_logp = old_logp.to(logp.dtype).detach()  # the behaviour policy is a constant

    ratio = torch.exp(logp - old_logp)  # (B, T)
    clipped_ratio = ratio.clamp(1.0 - eps_low, 1.0 + eps_high)
    per_token = torch.maximum(-ratio * advantages, -clipped_ratio * advantages)  # -min(rA, clip(r)A)
    negative = advantages < 0
    per_token = torch.where(negative, negative_weight * torch.minimum(per_token, -dual_clip * advantages), per_token)
    if behaviour_logp is not None:
        log_ratio = old_logp - behaviour_logp.to(logp.dtype).detach()
        weight = torch.exp(log_ratio)
        over = weight > is_cap
        if is_mode == "truncate":
            applied = weight.clamp(max=is_cap)
        elif is_mode == "mask":
            applied = torch.where(over, torch.zeros_like(weight), weight)
        else:
            raise ValueError(f"is_mode {is_mode!r}: expected 'truncate' or 'mask'")
        per_token = per_token * applied
    # where() rather than a multiply: a padded position can hold inf/nan and 0 * inf = nan
    per_token = torch.where(mask, per_token, torch.zeros_like(per_token))
    loss = per_token.sum() / _normaliser(mask, num_tokens)

    with torch.no_grad():
        count = max(int(mask.sum().item()), 1)
        positive = advantages > 0
        low = negative & (ratio < 1.0 - eps_low) & mask
        high = positive & (ratio > 1.0 + eps_high) & mask
        dual = negative & (ratio > dual_clip) & mask
        metrics = {
            "clip_frac_low": low.sum().item() / count,
            "clip_frac_high": high.sum().item() / count,
            "dual_clip_frac": dual.sum().item() / count,
        }
        if behaviour_logp is not None:
            metrics["is_weight_mean"] = applied[mask].sum().item() / count
            metrics["is_truncated_frac"] = (over & mask).sum().item() / count
            metrics["is_below_inverse_cap_frac"] = ((weight < 1 / is_cap) & mask).sum().item() / count
            metrics["is_log_ratio_mean"] = log_ratio[mask].sum().item() / count
            metrics["is_log_ratio_abs_mean"] = log_ratio[mask].abs().sum().item() / count
    return loss, metrics


def sft_loss(logp: Tensor, mask: Tensor, num_tokens: int | None = None) -> Tensor:
    """Masked token-mean cross-entropy: loss = -sum_{masked} log p(target) / num_tokens.

    Same convention as ppo_clip_loss: num_tokens counts the trained tokens of the whole batch so
    micro-batch losses add up; default mask.sum(). logp and mask (B, T): the targets' log-probs.
    """
    mask = mask.bool()
    nll = torch.where(mask, -logp, torch.zeros_like(logp))
    return nll.sum() / _normaliser(mask, num_tokens)
