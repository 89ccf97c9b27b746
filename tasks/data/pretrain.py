"""Pre-training documents for the tiny base model: copy drills, then problem statements and
their programs.

A real base model (Qwen3-14B-Base in the paper) already reads numbers and writes Python; a
model trained from scratch does not. Every generated problem needs one skill above all: copying
numbers, from the question into the program and from the tool's output into the answer. On
problem documents alone the tiny model never learned it (LOG.md, 2026-11-23 no-copying entry:
0 of 64 programs right after 1,500 steps); a short run of dense copy drills first makes the copy
mechanism form (a sudden drop in their loss), after which problem documents teach the programs
within a few hundred steps (LOG.md, 2026-11-23 copy-drills entry). All come from seeds disjoint
from the curated splits and carry no answers and no reasoning.
"""

from __future__ import annotations

import random

from tasks.config import TinyModelConfig
from tasks.data.problems import problem_statements
from tasks.train.sample import Sample


def copy_documents(n: int, seed: int) -> list[str]:
    """`Repeat: <numbers>\\n<numbers>\\n` with one to four numbers of one to eight digits."""
    rng = random.Random(seed)
    documents = []
    for _ in range(n):
        numbers = " ".join(
            str(rng.randint(10 ** (d - 1), 10**d - 1)) for d in (rng.randint(1, 8) for _ in range(rng.randint(1, 4)))
        )
        documents.append(f"Repeat: {numbers}\n{numbers}\n")
    return documents


def pretraining_documents(n: int, levels: list[int], seed: int) -> list[str]:
    return [f"{question}\n{code}\n" for _, _, question, code in problem_statements(n, levels, seed)]


def pack_documents(tokenizer, documents: list[str], seq_len: int) -> list[list[int]]:
    """Documents joined by the end-of-text token and cut into sequences of seq_len tokens."""
    separator = [tokenizer.pad_token_id]
    stream: list[int] = []
    for ids in tokenizer(documents, add_special_tokens=False)["input_ids"]:  # one batched call: 2x faster
        stream += ids + separator
    return [stream[i : i + seq_len] for i in range(0, len(stream) - seq_len + 1, seq_len)]


def pretraining_phases(
    tokenizer, tiny: TinyModelConfig, levels: list[int], seed: int
) -> list[tuple[list[Sample], int]]:
    """(packed samples, optimizer steps) per phase of the tiny model's pre-training: copy drills
    first, so the copy mechanism forms, then problem documents."""
    copy_steps = round(tiny.pretrain_steps * tiny.pretrain_copy_share)
    phases = []
    for documents, steps in ((copy_documents, copy_steps), (None, tiny.pretrain_steps - copy_steps)):
        if not steps:
            continue
        n = steps * tiny.pretrain_batch_size * 8  # documents are far shorter than a sequence
        texts = copy_documents(n, seed + 5) if documents else pretraining_documents(n, levels, seed + 2_000_003)
        packed = pack_documents(tokenizer, texts, tiny.pretrain_seq_len)
        phases.append(([Sample(ids, [1] * len(ids)) for ids in packed], steps))
    return phases
