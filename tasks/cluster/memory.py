"""What a model needs in memory, per GPU: a trainer rank's model states (as DeepSpeed's own
estimators count them), ZeRO-3's gathered largest layer, the activations and logits of a
micro-batch, and an engine's share as vLLM budgets it. Pure: numbers from a config and the
model's shapes (its config.json, the tiny model's fields, or model.shape).

The activation and logit terms count what autograd keeps in a Llama/Qwen decoder and are
calibrated per device against the measured peaks of real trainer steps: on CPU, resident memory
(bench/memory_bench.py); on a GPU, CUDA's allocator peak (bench/memory_bench.py --device cuda).
The numbers are in docs/benchmarks.md.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from tasks.config import InputError, RunConfig

GIB = 2**30
DTYPE_BYTES = {"bfloat16": 2, "float32": 4}
# Bytes per parameter of (weights, gradients, their fp32 copy, optimizer state) under DeepSpeed's
# mixed-precision Adam: 16-bit weights and gradients, the fp32 gradients the step reads, fp32
# master weights, m and v (4 + 4 + 4); DeepSpeed's estimators count the same 2 + 18. In float32
# the gradients need no copy, but ZeRO still keeps a master copy beside the module's weights.
TRAIN_BYTES = {"bfloat16": (2, 2, 4, 12), "float32": (4, 4, 0, 12)}


class PlanError(InputError):
    """A plan that cannot fit; the message is one line naming the config field to change."""


# ---------------------------------------------------------------- the model's size


@dataclass(frozen=True)
class ModelShape:
    """A decoder's shapes (Hugging Face config.json names) and its parameter count."""

    hf: dict
    source: str

    @property
    def params(self) -> float:
        return count_parameters(self.hf)

    @property
    def heads(self) -> int:
        return self.hf["num_attention_heads"]

    @property
    def head_dim(self) -> int:
        return self.hf.get("head_dim") or self.hf["hidden_size"] // self.heads

    @property
    def kv_heads(self) -> int:
        return self.hf.get("num_key_value_heads") or self.heads

    @property
    def largest_layer(self) -> int:
        """The most parameters one module holds (what ZeRO-3 gathers at once): the embedding."""
        hf = self.hf
        return max(hf["vocab_size"] * hf["hidden_size"], hf["hidden_size"] * hf["intermediate_size"])


def count_parameters(hf: dict) -> int:
    """A Llama/Qwen-style decoder from its config.json fields: embeddings (and an untied head), per
    layer q/k/v/o, a gated MLP and 2 norms; biases and q/k norms (under 0.1%) are left out."""
    hidden, heads = hf["hidden_size"], hf["num_attention_heads"]
    kv_heads, head_dim = hf.get("num_key_value_heads") or heads, hf.get("head_dim") or hidden // heads
    per_layer = hidden * head_dim * (2 * heads + 2 * kv_heads) + 3 * hidden * hf["intermediate_size"] + 2 * hidden
    embeddings = hf["vocab_size"] * hidden * (1 if hf.get("tie_word_embeddings", False) else 2)
    return embeddings + hf["num_hidden_layers"] * per_layer + hidden


def read_model_config(path: str) -> dict | None:
    """The model's config.json, or None where it is not readable (planning away from the cluster)."""
    try:
        return json.loads((Path(path) / "config.json").read_text())
    except (OSError, ValueError):
        return None


def model_shape(cfg: RunConfig) -> ModelShape:
    """The model's shapes: from model.path's config.json, the tiny model's fields, or model.shape."""
    model, t = cfg.model, cfg.model.tiny
    if model.path is None:
        hf = {"hidden_size": t.hidden_size, "num_attention_heads": t.num_heads, "vocab_size": t.vocab_size,
              "num_key_value_heads": t.num_kv_heads, "intermediate_size": t.intermediate_size,
              "num_hidden_layers": t.num_layers}  # fmt: skip
        return ModelShape(hf, "model.tiny")
    hf = read_model_config(model.path)
    needed = ("hidden_size", "num_attention_heads", "vocab_size", "intermediate_size", "num_hidden_layers")
    if hf and all(key in hf for key in needed):
        return ModelShape(hf, f"{model.path}/config.json")
    if model.shape is not None:
        return ModelShape(model.shape.model_dump(), "model.shape")
    raise PlanError(
        f"model.shape: {model.path}/config.json is not readable here (or not a decoder's); "
        "set model.shape to its fields (hidden_size, num_hidden_layers, ...)"
    )


def trainer_memory(params: float, dtype: str, zero_stage: int, ranks: int) -> dict[str, float]:
    """GiB of model states one rank holds: ZeRO-1 partitions the optimizer state and the fp32
    gradient copy over the ranks, ZeRO-2 also the 16-bit gradients, ZeRO-3 also the weights."""
    weights, grads, fp32_grads, optim = (b * params / GIB for b in TRAIN_BYTES[dtype])
    if dtype == "float32" and zero_stage == 0:
        optim -= 4 * params / GIB  # plain Adam on the module's own fp32 weights: no master copy
    share = lambda gib, stage: gib / ranks if zero_stage >= stage else gib  # noqa: E731
    return {"weights": share(weights, 3), "grads": share(grads, 2) + share(fp32_grads, 1), "optimizer": share(optim, 1)}


# What autograd keeps per token and layer of a Llama/Qwen decoder, in elements of the model's
# dtype: the two norms' inputs and outputs (4h), queries through RoPE, the expanded keys and
# values and the attention output (9 q-widths, 6 kv-widths; attention itself runs as a fused
# kernel, no score matrix), the gated MLP's four intermediates (4I); times the measured ratio of
# real steps' peaks to this count, per device (docs/benchmarks.md).


@dataclass(frozen=True)
class Calibration:
    """A device's measured ratios of a trainer step's peak to the counts below."""

    activations: float  # times layer_elements per token and layer
    checkpointed_widths: float  # hidden-wide tensors a checkpointed layer keeps per token
    logit_bytes: float  # bytes per (token x vocab) element of the logits, their copies and gradients
    phases: bool  # the peak is the larger of the update's and the optimizer step's, not their sum


CALIBRATION = {
    # Resident memory of real steps on CPU: the allocator returns little, so the parts add up.
    # Logits: 4.4 fp32 copies (the logits, the tempered copy, the log-softmax and their gradients).
    "cpu": Calibration(activations=1.25, checkpointed_widths=6, logit_bytes=4.4 * 4, phases=False),
    # torch.cuda.max_memory_allocated of real steps on an H200 (bf16, ZeRO-2, one rank): the
    # caching allocator reuses what a phase frees, so the update (activations, logits) and the
    # optimizer step (the fp32 gradients, a second 16-bit gradient buffer) peak apart. Logits: 16
    # bytes per element (the 16-bit logits, their fp32 copy, the log-softmax, and the gradients).
    "cuda": Calibration(activations=0.85, checkpointed_widths=1, logit_bytes=16, phases=True),
}
# vLLM's offline engine on a GPU of 70 GiB or more profiles a forward pass of this many tokens to
# size its activations (vllm/engine/arg_utils.py), and captures CUDA graphs unless eager.
ENGINE_PROFILE_TOKENS = 16384
CUDA_GRAPHS_GIB = 1.0  # typical for vLLM's captured batch sizes on one GPU; our assumption
ENGINE_PARTS = ("engine weights", "kv cache", "engine activations", "cuda graphs")


def layer_elements(shape: ModelShape) -> float:
    h, q, kv = shape.hf["hidden_size"], shape.heads * shape.head_dim, shape.kv_heads * shape.head_dim
    return 4 * h + 9 * q + 6 * kv + 4 * shape.hf["intermediate_size"]


def activation_memory(
    shape: ModelShape,
    tokens: int,
    dtype: str,
    checkpointing: bool,
    device: str = "cuda",
    chunk_tokens: int | None = None,
) -> dict[str, float]:
    """GiB one micro-batch of `tokens` needs at its peak: the layers' activations (with gradient
    checkpointing: what each layer keeps, plus one layer's while it is recomputed) and the logits
    (of at most chunk_tokens positions at once: trainer.logit_chunk_tokens)."""
    cal = CALIBRATION[device]
    per_layer = cal.activations * layer_elements(shape) * DTYPE_BYTES[dtype] * tokens
    layers = shape.hf["num_hidden_layers"]
    if checkpointing:
        kept = cal.checkpointed_widths * shape.hf["hidden_size"] * DTYPE_BYTES[dtype] * tokens
        activations = layers * kept + per_layer
    else:
        activations = layers * per_layer
    logit_bytes = cal.logit_bytes + (DTYPE_BYTES[dtype] if device == "cpu" and dtype != "float32" else 0)
    at_once = min(tokens, chunk_tokens or tokens)
    return {"activations": activations / GIB, "logits": logit_bytes * shape.hf["vocab_size"] * at_once / GIB}


def trainer_peak(
    shape: ModelShape,
    dtype: str,
    zero_stage: int,
    ranks: int,
    tokens: int,
    checkpointing: bool,
    chunk_tokens: int | None = None,
    device: str = "cuda",
) -> dict[str, float]:
    """GiB a trainer rank holds at its peak, by part: the model states, ZeRO-3's gathered layer,
    and then, on a GPU, the phase that binds: the update's activations and logits, or the
    optimizer step's fp32 gradients and buffers; on CPU all of them."""
    weights, grads, fp32_grads, optim = (b * shape.params / GIB for b in TRAIN_BYTES[dtype])
    states = trainer_memory(shape.params, dtype, zero_stage, ranks)
    if zero_stage == 3:  # its 16-bit weights and gradients whole while it runs (as DeepSpeed counts)
        states["gathered layer"] = 4 * shape.largest_layer / GIB
    update = activation_memory(shape, tokens, dtype, checkpointing, device, chunk_tokens)
    if not CALIBRATION[device].phases:
        return states | update
    fp32_share = fp32_grads / ranks if zero_stage >= 1 else fp32_grads
    grads_share = grads / ranks if zero_stage >= 2 else grads
    states["grads"] -= fp32_share  # held only from the optimizer step's start
    step = {"fp32 grads": fp32_share, "step buffers": grads_share}
    return states | (update if sum(update.values()) >= sum(step.values()) else step)


def rollout_tokens(cfg: RunConfig, budget: int) -> int:
    """A rollout's most tokens at a response budget: the budget plus the prompt, which gets what
    engines.max_model_len leaves beside the longest budget (evaluation's included)."""
    budgets = [s.max_response_tokens for s in cfg.rl.stages]
    prompt = max(cfg.engines.max_model_len - max([*budgets, cfg.eval.max_response_tokens]), 0)
    return min(cfg.engines.max_model_len, budget + prompt)


def trained_micro_batch(cfg: RunConfig) -> tuple[str, int]:
    """The phase whose micro-batch holds the most tokens, and how many: SFT's samples are at most
    sft.max_len; an RL rollout at most rollout_tokens at its stage's budget."""
    rollout = rollout_tokens(cfg, max([s.max_response_tokens for s in cfg.rl.stages], default=0))  # no stages: SFT
    rl, sft = cfg.rl.optim.micro_batch_size * rollout, cfg.sft.optim.micro_batch_size * cfg.sft.max_len
    return ("rl", rl) if rl >= sft else ("sft", sft)


def engine_memory(cfg: RunConfig, shape: ModelShape) -> dict[str, float]:
    """GiB an engine's GPU holds, as vLLM budgets it: its share of the weights, the KV cache it is
    given, the activations of its profiling pass (and the sampler's fp32 logits), CUDA graphs."""
    tp, b = cfg.engines.tensor_parallel_size, DTYPE_BYTES[cfg.model.dtype]
    hf = shape.hf
    # A forward pass holds a few hidden-wide and MLP-wide tensors at once, not a layer's stack.
    profile = ENGINE_PROFILE_TOKENS * (4 * hf["hidden_size"] + 3 * hf["intermediate_size"] / tp) * b
    sampler = cfg.engines.max_num_seqs * hf["vocab_size"] * 4
    parts = {
        "engine weights": b * shape.params / tp / GIB,
        "kv cache": cfg.engines.kv_cache_gib,
        "engine activations": (profile + sampler) / GIB,
    }
    return parts | ({} if cfg.engines.enforce_eager else {"cuda graphs": CUDA_GRAPHS_GIB})
