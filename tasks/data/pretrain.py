"""Pre-training documents for the tiny base model: copy drills, then problem statements and
their programs.

A real base model (Qwen3-14B-Base in the paper) already reads numbers and writes Python; a
model trained from scratch does not. Every generated problem needs one skill above all: copying
numbers, from the question into the program and from the tool's output into the answer. On
problem documents alone the tiny model never learned it (0 of 64 programs right after 1,500
steps); a short run of dense copy drills first makes the copy
mechanism form (a sudden drop in their loss), after which problem documents teach the programs
within a few hundred steps. All come from seeds disjoint
from the curated splits and carry no answers and no reasoning.
"""

from __future__ import annotations

import random
from collections.abc import Iterator

from tasks.config import PretrainLayouts, RunConfig, TinyModelConfig
from tasks.data.chat_examples import program_error, tool_call_example
from tasks.data.problems import RECURSION_LIMIT_OFF, guard_of, problem_statements, unguarded
from tasks.data.tool_tasks import tool_tasks
from tasks.records import Sample
from tasks.rollout.format import IM_END, tool_call_text, tool_response_text, user_turn_text


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


def guard_failures(levels: list[int], seed: int, kinds: list[str] | None) -> Iterator[tuple[str, str, str]]:
    """(question, program, error) of RL problems whose program fails without its guard, without end."""
    misses = 0
    for _, _, question, code in problem_statements(10**9, levels, seed, kinds):
        error = program_error(unguarded(code)) if guard_of(code) else None
        if error is not None:
            misses = 0
            yield question, code, error
        elif (misses := misses + 1) > 10_000:
            raise ValueError(f"no problem of {kinds or 'any kind'} at levels {levels} fails without its guard")


def pretraining_documents(
    n: int,
    levels: list[int],
    seed: int,
    layouts: PretrainLayouts,
    tool_name: str,
    tool_spec: str,
    unguarded_share: float = 0.0,
    kinds: list[str] | None = None,
) -> list[str]:
    """n documents, each layout drawn by its share: problem statements of the RL kinds followed by
    their program as plain text, as a bare tool call, or as the assistant's call after the question
    in a user turn (the rollout's turns, without system prompt, output or answer); the same turns
    with a first call that fails for want of its guard, the error and the guarded call (`fix`); and
    whole rollout-format transcripts of tool tasks that are not RL kinds (so the chat form is not
    new to the model, while no RL problem appears with its output or answer). An
    `unguarded_share` of the other programs omit the digit limit's lift their larger inputs need,
    as first attempts often do; a recursion never shows its limit raised before its error."""
    rng = random.Random(seed)
    names = ["plain", "tool_call", "user_turn", "chat", "fix"]
    drawn = rng.choices(names, weights=[getattr(layouts, name) for name in names], k=n)
    statements = problem_statements(sum(layout not in ("chat", "fix") for layout in drawn), levels, seed, kinds)
    failures = guard_failures(levels, seed + 1, kinds) if "fix" in drawn else iter(())
    documents = []
    for layout in drawn:
        if layout == "chat":
            transcript = tool_call_example(*tool_tasks(1, rng)[0], tool_name, tool_spec)
            documents.append("".join(text for text, _ in transcript))
            continue
        if layout == "fix":
            question, code, error = next(failures)
            first = tool_call_text(tool_name, unguarded(code))
            fixed = tool_call_text(tool_name, code)
            documents.append(f"{user_turn_text(question)}{first}{tool_response_text(error.strip())}{fixed}{IM_END}\n")
            continue
        _, _, question, code = next(statements)
        if code.startswith(RECURSION_LIMIT_OFF) or (unguarded_share and rng.random() < unguarded_share):
            code = unguarded(code)
        if layout == "user_turn":
            documents.append(f"{user_turn_text(question)}{tool_call_text(tool_name, code)}{IM_END}\n")
        else:
            documents.append(f"{question}\n{code if layout == 'plain' else tool_call_text(tool_name, code)}\n")
    return documents


def pack_documents(tokenizer, documents: list[str], seq_len: int) -> list[list[int]]:
    """Documents joined by the end-of-text token and cut into sequences of seq_len tokens."""
    if not documents:  # the fast tokenizer fails on an empty batch
        return []
    separator = [tokenizer.pad_token_id]
    stream: list[int] = []
    for ids in tokenizer(documents, add_special_tokens=False)["input_ids"]:  # one batched call: 2x faster
        stream += ids + separator
    return [stream[i : i + seq_len] for i in range(0, len(stream) - seq_len + 1, seq_len)]


def packed_samples(tokenizer, documents: list[str], seq_len: int) -> list[Sample]:
    return [Sample(ids, [1] * len(ids)) for ids in pack_documents(tokenizer, documents, seq_len)]


def copy_drill_samples(tokenizer, tiny: TinyModelConfig, seed: int) -> list[Sample]:
    """Enough packed copy drills for the most drill steps the config allows."""
    n = tiny.pretrain_copy_steps * tiny.pretrain_batch_size * tiny.pretrain_seq_len // 24  # ~30 tokens each
    return packed_samples(tokenizer, copy_documents(n, seed + 5), tiny.pretrain_seq_len)


def copy_probe_samples(tokenizer, n: int, seed: int) -> list[Sample]:
    """n fresh drills, one a sample, with the copy and the newline that ends it as the target: the
    copy mechanism has formed when the model reproduces them exactly (`Trainer.exact_match`).
    Scored on the copy alone, a model that goes on writing digits after a right copy passed, and
    greedy decoding, which must also stop, copied far fewer (LOG.md, 2026-11-27 copy-check entry)."""
    samples = []
    for document in copy_documents(n, seed):
        prefix, _, copy = document.rpartition("\n")[0].rpartition("\n")
        first = tokenizer(prefix + "\n", add_special_tokens=False).input_ids
        second = tokenizer(copy + "\n", add_special_tokens=False).input_ids
        samples.append(Sample(first + second, [0] * len(first) + [1] * len(second)))
    return samples


def document_samples(tokenizer, cfg: RunConfig, seed: int) -> list[Sample]:
    """Enough packed documents (every layout the config shares out) for the document steps."""
    tiny = cfg.model.tiny
    n = tiny.pretrain_steps * tiny.pretrain_batch_size * tiny.pretrain_seq_len // 32  # ~45 tokens or more
    documents = pretraining_documents(
        n,
        cfg.data.levels,
        seed + 2_000_003,
        tiny.pretrain_layouts,
        cfg.rollout.tool_name,
        cfg.rollout.tool_spec,
        tiny.pretrain_unguarded_share,
        cfg.data.kinds,
    )
    return packed_samples(tokenizer, documents, tiny.pretrain_seq_len)
