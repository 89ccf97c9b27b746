"""The embedded default model: a byte-level BPE tokenizer and a Qwen2 or Qwen3 LM from scratch.

Both are saved as one Hugging Face directory that transformers and vLLM load like any real
model (a Qwen3 one as they load Qwen3-14B-Base, the paper's base model). Everything is
deterministic from the corpus and the seed.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

import torch
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import (
    GenerationConfig,
    PreTrainedTokenizerFast,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
)

from tasks.config import RolloutConfig, TinyModelConfig
from tasks.rollout.format import END_OF_TEXT, IM_END, SPECIAL_TOKENS, TAG_TOKENS


def train_tokenizer(corpus: Iterable[str], vocab_size: int, tool_name: str) -> PreTrainedTokenizerFast:
    """BPE over the corpus; the chat tags and the tool's name are single tokens. The name whole:
    byte-level BPE cuts it at every underscore (11 tokens for execute_python_code_with_standard_io),
    and a policy that misspells one of them calls no tool at all."""
    tokenizer = Tokenizer(models.BPE())
    # One token per digit: copying a number into a program is then a per-digit copy, which a
    # tiny model learns far more easily than arbitrary multi-digit merges.
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)]
    )
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(corpus, trainer)
    # Tags stay non-special so decoded text (and vLLM's stop strings) still contain them.
    tokenizer.add_tokens([AddedToken(tag, special=False, normalized=False) for tag in [*TAG_TOKENS, tool_name]])
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token=IM_END, pad_token=END_OF_TEXT)


def build_tiny_model(
    cfg: TinyModelConfig, corpus: Iterable[str], seed: int, out_dir: Path, tool_name: str = RolloutConfig().tool_name
) -> Path:
    """Train the tokenizer, initialise the model from the seed, save both to out_dir."""
    tokenizer = train_tokenizer(corpus, cfg.vocab_size, tool_name)
    eos_id = tokenizer.convert_tokens_to_ids(IM_END)
    config_class, model_class = {"qwen2": (Qwen2Config, Qwen2ForCausalLM), "qwen3": (Qwen3Config, Qwen3ForCausalLM)}[
        cfg.architecture
    ]
    config = config_class(
        vocab_size=64 * -(-len(tokenizer) // 64),  # rounded up: friendlier matmul shapes
        hidden_size=cfg.hidden_size,
        intermediate_size=cfg.intermediate_size,
        num_hidden_layers=cfg.num_layers,
        num_attention_heads=cfg.num_heads,
        num_key_value_heads=cfg.num_kv_heads,
        head_dim=cfg.hidden_size // cfg.num_heads,
        max_position_embeddings=cfg.max_position_embeddings,
        # vLLM 0.32 (CPU) keeps a stale packed lm_head after a weight reload when tied.
        tie_word_embeddings=False,
        bos_token_id=eos_id,
        eos_token_id=eos_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    torch.manual_seed(seed)
    model = model_class(config)
    out_dir.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    GenerationConfig(eos_token_id=eos_id, pad_token_id=tokenizer.pad_token_id).save_pretrained(out_dir)
    return out_dir
