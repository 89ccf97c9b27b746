"""Pre-training documents for the tiny base model: problem statements and their programs.

A real base model (Qwen3-14B-Base in the paper) already reads numbers and writes Python; a
model trained from scratch does not, and SFT alone did not teach it to copy a number from the
question into a program (LOG.md). These documents teach exactly that. They come from a seed
disjoint from the curated splits, and carry no answers and no reasoning.
"""

from __future__ import annotations

from tasks.data.problems import generate_problems


def pretraining_documents(n: int, levels: list[int], seed: int) -> list[str]:
    return [f"{p.question}\n{p.solution_code}\n" for p in generate_problems(n, levels, seed)]


def pack_documents(tokenizer, documents: list[str], seq_len: int) -> list[list[int]]:
    """Documents joined by the end-of-text token and cut into sequences of seq_len tokens."""
    separator = [tokenizer.pad_token_id]
    stream: list[int] = []
    for document in documents:
        stream += tokenizer(document, add_special_tokens=False)["input_ids"] + separator
    return [stream[i : i + seq_len] for i in range(0, len(stream) - seq_len + 1, seq_len)]
