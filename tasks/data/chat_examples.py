"""Non-reasoning SFT examples: tool-call formatting and instruction following.

Two kinds of source: the generated set below, and chats from files (function-calling and
instruction-following data sets, OpenAI / Hermes message lists) rendered by `chat_segments` into
the same rollout format, with the chat's own tools listed in the system prompt.

The generated set comes in two modes (`sft.mode`), the two arms of the paper's cold-start
question:
- `non_reasoning` (the paper's SFT): tool calls on tasks that need the tool but are not the math
  problems RL trains on (tasks/data/tool_tasks.py: the assistant writes the call, the tool
  answers, the assistant reports what it printed; in a `recovery_share` of them a failed call and
  its error come first), answer-format instructions and short chats. The math reasoning is left
  to the base model's pre-training and to RL.
- `reasoning`: problems of the RL kinds (from a seed disjoint from the curated splits), posed
  as RL poses them, and the program that solves each: reasoning in code form, as a reasoning SFT
  would teach it.
Each example is a list of (text, trainable) segments in the rollout format.
"""

from __future__ import annotations

import json
import linecache
import random
import sys
import threading
import traceback
from collections.abc import Iterator
from pathlib import Path

from tasks.config import MalformedRows, RunConfig, SftMode, SftSourceConfig
from tasks.data.problems import generate_problems, guard_of, own_limits, unguarded
from tasks.data.sources import Rejected, SourceError, malformed_row, partition, read_records
from tasks.data.tool_tasks import CHATS, instruction, tool_tasks
from tasks.rollout.format import (
    IM_END,
    TOOL_CALL_CLOSE,
    TOOL_CALL_OPEN,
    ToolCallError,
    answer_text,
    function_call_text,
    parse_tool_call,
    prompt_text,
    tool_call_text,
    tool_response_text,
    user_turn_text,
)

Segments = list[tuple[str, bool]]


class MalformedChat(ValueError):
    """A chat without its question (a first user message) or its answer (a last assistant message):
    malformed data, unlike the chats the recipe leaves out by choice (reasoning traces, ...)."""


def tool_call_example(question: str, code: str, answer: str, tool_name: str, tool_spec: str) -> Segments:
    return [
        (prompt_text(question, tool_name, tool_spec), False),
        (tool_call_text(tool_name, code), True),
        (tool_response_text(answer), False),
        (answer_text(answer), True),
    ]


# The recursion limit under which a program run in a fresh thread has as many frames as in a
# sandbox cell under Python's default 1,000 (to within one), whatever its caller's stack: measured,
# the thread's own calls hold fewer than the cell's (tests/test_sandbox.py compares the tracebacks).
_THREAD_RECURSION_LIMIT = 993


def program_error(source: str) -> str | None:
    """The error text the sandbox prints for `source`, or None if it runs (Python's own, produced
    here the way the sandbox's runner does: generated, trusted code that fails before doing any
    work, at its first conversion past the digit limit or its recursion's 1,000th frame; what it
    prints is dropped)."""
    linecache.cache["<code>"] = (len(source), None, source.splitlines(True), "<code>")  # quoted in tracebacks
    failures: list[BaseException] = []

    def run() -> None:
        try:
            exec(compile(source, "<code>", "exec"), {"print": lambda *_: None})  # noqa: S102
        except (SyntaxError, NameError, ValueError, RecursionError) as exc:
            failures.append(exc)

    with own_limits(digits_lifted=False):
        sys.setrecursionlimit(_THREAD_RECURSION_LIMIT)
        thread = threading.Thread(target=run)
        thread.start()
        thread.join()
    if not failures:
        return None
    exc = failures[0]
    if isinstance(exc, SyntaxError):
        return "".join(traceback.format_exception_only(type(exc), exc))
    # `run`'s own frame is not shown, as the runner's is not in the sandbox
    return "".join(traceback.format_exception(type(exc), exc, exc.__traceback__.tb_next))


def broken_program(code: str, rng: random.Random) -> tuple[str, str]:
    """A plausible first attempt at `code` that fails, and its error text. A program that lifts
    a limit is first tried without the lift: the failure its first attempt meets where its
    numbers pass the limit."""
    slips = ["typo", "unclosed"] + (["no_import"] if code.startswith("import ") else [])
    kinds = (["limit"] if guard_of(code) else []) + [rng.choice(slips)]
    for kind in kinds:
        broken = {
            "typo": code.replace("print(", "prnt(", 1),
            "unclosed": code[:-1],
            "no_import": code.partition("\n")[2],
            "limit": unguarded(code),
        }[kind]
        error = program_error(broken)
        if error is not None:
            return broken, error
    raise ValueError(f"no variant of {code!r} failed ({', '.join(kinds)})")


def malformed_call(tool_name: str, code: str, rng: random.Random) -> tuple[str, str]:
    """A call of `code` with one character of its JSON dropped, the slip a sampling model makes
    most (parse errors are ~80% of failed calls in stage-1 rollouts), and the parse error the
    agent loop answers it with. A drop that still parses (a digit of the program) is drawn again."""
    call = tool_call_text(tool_name, code)
    for _ in range(100):
        cut = rng.randrange(len(TOOL_CALL_OPEN), len(call) - len(TOOL_CALL_CLOSE))
        broken = call[:cut] + call[cut + 1 :]
        try:
            parse_tool_call(broken, tool_name)
        except ToolCallError as exc:
            return broken, str(exc)
    raise ValueError(f"no one-character drop of {call!r} fails to parse")


def recovery_example(
    question: str, code: str, answer: str, tool_name: str, tool_spec: str, rng: random.Random
) -> Segments:
    """A failing tool call (half malformed, half a failing program; a program that lifts a limit
    always fails for want of the lift), its error, the corrected call and the answer. The
    failing call is context, not a target: the model learns to recover from an error, not to make
    one. This is what gives RL positive trajectories that contain tool errors, the ones RoC
    filters out."""
    if guard_of(code) is None and rng.random() < 0.5:
        first_call, error = malformed_call(tool_name, code, rng)
    else:
        broken, error = broken_program(code, rng)
        first_call = tool_call_text(tool_name, broken)
    return [
        (prompt_text(question, tool_name, tool_spec), False),
        (first_call, False),
        (tool_response_text(error), False),
        (tool_call_text(tool_name, code), True),
        (tool_response_text(answer), False),
        (answer_text(answer), True),
    ]


def instruction_example(instruction: str, answer: str, tool_name: str, tool_spec: str) -> Segments:
    return [(prompt_text(instruction, tool_name, tool_spec), False), (answer_text(answer), True)]


def chat_example(message: str, reply: str, tool_name: str, tool_spec: str) -> Segments:
    return [(prompt_text(message, tool_name, tool_spec), False), (reply + IM_END, True)]


def build_sft_examples(
    n: int,
    levels: list[int],
    seed: int,
    tool_name: str,
    tool_spec: str = "schema",
    tool_share: float = 0.8,
    recovery_share: float = 0.0,
    mode: SftMode = "non_reasoning",
    kinds: list[str] | None = None,
) -> list[Segments]:
    """n examples, a `tool_share` of them tool calls, a `recovery_share` of those recovering
    from a failed first call; the rest answer-format instructions (and in `non_reasoning` mode a
    third of them short chats). Deterministic from the seed."""
    rng = random.Random(seed)
    n_tool = round(n * tool_share)
    n_recovery = round(n_tool * recovery_share)
    if mode == "reasoning":
        # Offset the seed so these problems are not the curated train/held-out problems.
        problems = generate_problems(n_tool, levels, seed=seed + 1_000_003, kinds=kinds)
        tasks = [(p.question, p.solution_code, p.answer) for p in problems]
        n_chat = 0
    else:
        tasks = tool_tasks(n_tool, rng)
        n_chat = (n - n_tool) // 3
    examples = [recovery_example(*task, tool_name, tool_spec, rng) for task in tasks[:n_recovery]]
    examples += [tool_call_example(*task, tool_name, tool_spec) for task in tasks[n_recovery:]]
    examples += [instruction_example(*instruction(rng), tool_name, tool_spec) for _ in range(n - n_tool - n_chat)]
    examples += [chat_example(*rng.choice(CHATS), tool_name, tool_spec) for _ in range(n_chat)]
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


def _tool_call(call) -> tuple[str, dict]:
    """(name, arguments) of one tool call, OpenAI ({"function": {...}}) or flat style."""
    if not isinstance(call, dict):
        raise ValueError(f"a tool call is {type(call).__name__}, not an object")
    call = call.get("function", call)
    name, arguments = call.get("name"), call.get("arguments", {})
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError as exc:
            raise ValueError(f"tool call arguments are not JSON: {exc}") from None
    if not isinstance(name, str) or not isinstance(arguments, dict):
        raise ValueError("a tool call needs a string 'name' and object 'arguments'")
    return name, arguments


def _text(message: dict, role: str) -> str:
    content = message.get("content") or ""
    if not isinstance(content, str):
        raise ValueError(f"{role} content is {type(content).__name__}, not text")
    return content


def chat_segments(messages, tools, tool_name: str, tool_spec: str) -> Segments:
    """One chat in the rollout format; ValueError says why a chat cannot be used.

    Trainable: the assistant's words and tool calls. A system message is replaced by the
    rollout system prompt (listing the chat's `tools`, or the Python tool when it has none); each
    tool result comes back as the rollout's tool-response turn. One tool call per assistant turn,
    as in rollouts; chats with reasoning traces (<think>) are refused: the paper's SFT teaches
    formats, not math reasoning."""
    if isinstance(tools, str):
        tools = json.loads(tools) if tools.strip() else None
    if tools is not None and (not isinstance(tools, list) or not all(isinstance(t, dict) for t in tools)):
        raise ValueError("tools must be a list of JSON schemas")
    if not isinstance(messages, list) or not all(isinstance(m, dict) for m in messages):
        raise MalformedChat("messages must be a list of objects with a role")
    turns = [m for m in messages if m.get("role") != "system"]
    if not turns or turns[0].get("role") != "user":
        raise MalformedChat("a chat must start with a user message")
    if turns[-1].get("role") != "assistant" or turns[-1].get("tool_calls"):
        raise MalformedChat("a chat must end with an assistant message that calls no tool")
    segments: Segments = []
    previous = None
    for message in turns:
        role = message.get("role")
        if role == "user":
            if previous not in (None, "assistant"):
                raise ValueError(f"a user message after a {previous} message")
            text = _text(message, role)
            if previous is None:
                segments.append((prompt_text(text, tool_name, tool_spec, tools or None), False))
            else:
                segments.append(("\n" + user_turn_text(text), False))
        elif role == "assistant":
            if previous not in ("user", "tool"):
                raise ValueError(f"an assistant message after a {previous} message")
            content = _text(message, role)
            if "<think>" in content:
                raise ValueError("a reasoning trace (<think>): SFT data must not teach math reasoning")
            calls = message.get("tool_calls") or []
            if len(calls) > 1:
                raise ValueError(f"{len(calls)} tool calls in one turn; the rollout format has one per turn")
            if calls:
                segments.append((content + function_call_text(*_tool_call(calls[0])), True))
            else:
                segments.append((content + IM_END, True))
        elif role == "tool":
            if previous != "assistant" or not segments[-1][0].endswith("</tool_call>"):
                raise ValueError("a tool message must answer an assistant tool call")
            segments.append((tool_response_text(_text(message, role)), False))
        else:
            raise ValueError(f"unknown role {role!r}")
        previous = role
    return segments


def chats_from_file(*args, **kwargs) -> tuple[list[Segments], list[Rejected]]:
    """Every usable chat of a file as segments; the others with their row id and reason (`read_chats`' arguments)."""
    return partition(read_chats(*args, **kwargs))


def read_chats(
    name: str,
    fmt: str,
    path,
    messages: str,
    tools: str | None,
    limit: int | None,
    tool_name: str,
    tool_spec: str,
    malformed: MalformedRows = "error",
) -> Iterator[Segments | Rejected]:
    """A file's chats one at a time: each usable one as segments, each other one with its row id
    and reason; under `malformed="error"` a SourceError at the first chat without its question or
    answer, naming the file, the row and the column."""
    columns, records = read_records(fmt, Path(path), columns=[c for c in (messages, tools) if c])
    if columns is not None and messages not in columns:
        raise SourceError(f"{path}: no column {messages!r}; its columns: {columns}")
    usable = 0
    for number, record in enumerate(records):
        if limit is not None and usable >= limit:
            break
        try:
            if messages not in record:
                raise MalformedChat(f"no {messages!r}")
            segments = chat_segments(record[messages], record.get(tools) if tools else None, tool_name, tool_spec)
        except MalformedChat as exc:
            if malformed == "error":
                raise malformed_row(Path(path), number, f"{exc} ({messages})") from None
            yield Rejected(f"{name}:{number}", name, "sft", str(exc))
        except (ValueError, TypeError) as exc:
            yield Rejected(f"{name}:{number}", name, "sft", str(exc))
        else:
            usable += 1
            yield segments


def file_chats(source: SftSourceConfig, cfg: RunConfig) -> Iterator[Segments | Rejected]:
    """An SFT file source's chats one at a time, in the run's rollout format."""
    return read_chats(
        source.name,
        source.format,
        source.path,
        source.messages,
        source.tools,
        source.limit,
        cfg.rollout.tool_name,
        cfg.rollout.tool_spec,
        cfg.data.malformed_rows,
    )


def sft_examples(
    cfg: RunConfig, recovery: bool = True, mode: SftMode | None = None
) -> tuple[list[Segments], dict[str, float]]:
    """Every configured SFT source's examples, and per source how many were used and set aside
    (also printed, with the first reasons). `recovery`: False leaves out the generated examples
    that recover from a failed call; `mode` replaces `sft.mode`."""
    examples: list[Segments] = []
    counts: dict[str, float] = {}
    for source in cfg.sft.sources:
        if source.format == "generated":
            share = cfg.sft.recovery_share if recovery else 0.0
            found, rejected = (
                build_sft_examples(
                    cfg.sft.n_examples,
                    cfg.data.levels,
                    cfg.seed,
                    cfg.rollout.tool_name,
                    cfg.rollout.tool_spec,
                    recovery_share=share,
                    mode=mode or cfg.sft.mode,
                    kinds=cfg.data.kinds,
                ),
                [],
            )
        else:
            found, rejected = partition(file_chats(source, cfg))
        examples += found
        counts[f"sft/{source.name}/examples"], counts[f"sft/{source.name}/rejected"] = len(found), len(rejected)
        reasons = "; ".join(f"{r.row_id}: {r.reason}" for r in rejected[:5])
        aside = f" ({reasons})" if reasons else ""
        print(f"sft source {source.name}: {len(found)} examples, {len(rejected)} set aside{aside}")
    return examples, counts
