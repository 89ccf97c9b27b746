"""The embedded default model: a byte-level BPE tokenizer and a Qwen2-style LM from scratch.

Both are saved as one Hugging Face directory that transformers and vLLM load like any real
model. Everything is deterministic from the corpus and the seed.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

import torch
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import GenerationConfig, PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

from tasks.config import TinyModelConfig
from tasks.rollout.format import END_OF_TEXT, IM_END, SPECIAL_TOKENS, TAG_TOKENS


def train_tokenizer(corpus: Iterable[str], vocab_size: int) -> PreTrainedTokenizerFast:
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
    tokenizer.add_tokens([AddedToken(tag, special=False, normalized=False) for tag in TAG_TOKENS])
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token=IM_END, pad_token=END_OF_TEXT)


def build_tiny_model(cfg: TinyModelConfig, corpus: Iterable[str], seed: int, out_dir: Path) -> Path:
    """Train the tokenizer, initialise the model from the seed, save both to out_dir."""
    tokenizer = train_tokenizer(corpus, cfg.vocab_size)
    eos_id = tokenizer.convert_tokens_to_ids(IM_END)
    config = Qwen2Config(
        vocab_size=64 * -(-len(tokenizer) // 64),  # rounded up: friendlier matmul shapes
        hidden_size=cfg.hidden_size,
        intermediate_size=cfg.intermediate_size,
        num_hidden_layers=cfg.num_layers,
        num_attention_heads=cfg.num_heads,
        num_key_value_heads=cfg.num_kv_heads,
        max_position_embeddings=cfg.max_position_embeddings,
        # vLLM 0.32 (CPU) keeps a stale packed lm_head after a weight reload when tied.
        tie_word_embeddings=False,
        bos_token_id=eos_id,
        eos_token_id=eos_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    torch.manual_seed(seed)
    model = Qwen2ForCausalLM(config)
    out_dir.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    GenerationConfig(eos_token_id=eos_id, pad_token_id=tokenizer.pad_token_id).save_pretrained(out_dir)
    return out_dir
