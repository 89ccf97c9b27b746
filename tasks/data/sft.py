"""Non-reasoning SFT examples: tool-call formatting and instruction following.

As the paper prescribes, no math reasoning traces: an example either follows an explicit
instruction to use the Python tool (the assistant writes the call, the tool answers, the
assistant reports the printed value) or an instruction to report a given number in the answer
format. Problems for tool-call examples are generated from a seed disjoint from the curated
splits. Each example is a list of (text, trainable) segments in the rollout format.
"""

from __future__ import annotations

import random

from tasks.data.problems import generate_problems
from tasks.rollout.format import answer_text, prompt_text, tool_call_text, tool_response_text

Segments = list[tuple[str, bool]]


def tool_call_example(question: str, code: str, answer: str, tool_name: str, tool_spec: str) -> Segments:
    return [
        (prompt_text(f"Use the Python tool. {question}", tool_name, tool_spec), False),
        (tool_call_text(tool_name, code), True),
        (tool_response_text(answer), False),
        (answer_text(answer), True),
    ]


def instruction_example(number: int, tool_name: str, tool_spec: str) -> Segments:
    return [
        (prompt_text(f"Reply with the number {number} as your final answer.", tool_name, tool_spec), False),
        (answer_text(str(number)), True),
    ]


def build_sft_examples(n: int, levels: list[int], seed: int, tool_name: str, tool_spec: str = "schema",
                       tool_share: float = 0.8) -> list[Segments]:
    """n examples, a `tool_share` of them tool calls; deterministic from the seed."""
    rng = random.Random(seed)
    n_tool = round(n * tool_share)
    # Offset the seed so these problems are not the curated train/held-out problems.
    problems = generate_problems(n_tool, levels, seed=seed + 1_000_003)
    examples = [tool_call_example(p.question, p.solution_code, p.answer, tool_name, tool_spec) for p in problems]
    examples += [instruction_example(rng.randint(0, 10**6), tool_name, tool_spec) for _ in range(n - n_tool)]
    rng.shuffle(examples)
    return examples


def tokenize_segments(tokenizer, segments: Segments) -> tuple[list[int], list[int]]:
    """Token ids and loss mask, each segment tokenized on its own as the agent loop does."""
    ids: list[int] = []
    mask: list[int] = []
    for text, trainable in segments:
        piece = tokenizer(text, add_special_tokens=False)["input_ids"]
        ids += piece
        mask += [int(trainable)] * len(piece)
    return ids, mask
