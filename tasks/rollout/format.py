"""The chat and tool-call format of recipe.md section 2, as text segments.

A trajectory is a sequence of segments, each tokenized on its own and concatenated, so the
token ids the trainer sees are exactly the ones the engine produced or was fed:
  prompt (system + user + "assistant" header)      mask 0
  assistant turn, generated, ends at </tool_call>  mask 1
  tool response turn, injected                     mask 0
  ... more turns ...
  final assistant turn, ends at <|im_end|>         mask 1
SFT examples are rendered through the same functions, so SFT and RL share one format.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

IM_START, IM_END, END_OF_TEXT = "<|im_start|>", "<|im_end|>", "<|endoftext|>"
TOOL_CALL_OPEN, TOOL_CALL_CLOSE = "<tool_call>", "</tool_call>"
TOOL_RESPONSE_OPEN, TOOL_RESPONSE_CLOSE = "<tool_response>", "</tool_response>"
ANSWER_OPEN, ANSWER_CLOSE = "<answer>", "</answer>"

# Added to the tokenizer as single tokens; IM_* are special (never produced by BPE merges),
# the tag tokens are plain added tokens so that decoded text still shows them.
SPECIAL_TOKENS = [END_OF_TEXT, IM_START, IM_END]
TAG_TOKENS = [TOOL_CALL_OPEN, TOOL_CALL_CLOSE, TOOL_RESPONSE_OPEN, TOOL_RESPONSE_CLOSE, ANSWER_OPEN, ANSWER_CLOSE]


def tool_schema(tool_name: str) -> dict:
    return {
        "type": "function",
        "function": {
            "name": tool_name,
            "description": "Run a Python program with the given standard input and return what it prints.",
            "parameters": {
                "type": "object",
                "properties": {
                    "code": {"type": "string", "description": "the Python program"},
                    "input": {"type": "string", "description": "its standard input"},
                },
                "required": ["code", "input"],
            },
        },
    }


def compact_tool_schema(tool_name: str) -> dict:
    """The same tool in a few tokens: a small model pays for every prompt token in every step."""
    return {"name": tool_name, "arguments": {"code": "string", "input": "string"}}


def system_prompt(tool_name: str, tool_spec: str = "schema", tools: list[dict] | None = None) -> str:
    """Asks for reasoning, one <answer> block with \\boxed{}, and lists the tools Hermes-style:
    the Python tool, or `tools` (the schemas of an SFT chat's own tools)."""
    if tools is None:
        tools = [tool_schema(tool_name) if tool_spec == "schema" else compact_tool_schema(tool_name)]
    listed = "\n".join(json.dumps(t) for t in tools)
    return (
        "You are a helpful assistant. Reason step by step, then give the final answer in a single "
        f"{ANSWER_OPEN}{ANSWER_CLOSE} block with the final number in \\boxed{{}}.\n"
        f"You may call {'this tool' if len(tools) == 1 else 'these tools'}:\n<tools>\n"
        f"{listed}\n</tools>\n"
        f'Call it as {TOOL_CALL_OPEN}{{"name": <tool name>, "arguments": <arguments as JSON>}}{TOOL_CALL_CLOSE}'
    )


def prompt_text(problem: str, tool_name: str, tool_spec: str = "schema", tools: list[dict] | None = None) -> str:
    """System and user turns, then the open assistant header the model continues from."""
    return f"{IM_START}system\n{system_prompt(tool_name, tool_spec, tools)}{IM_END}\n" + user_turn_text(problem)


def user_turn_text(content: str) -> str:
    return f"{IM_START}user\n{content}{IM_END}\n{IM_START}assistant\n"


def tool_call_text(tool_name: str, code: str, stdin: str = "") -> str:
    return function_call_text(tool_name, {"code": code, "input": stdin})


def function_call_text(name: str, arguments: dict) -> str:
    return f"{TOOL_CALL_OPEN}{json.dumps({'name': name, 'arguments': arguments})}{TOOL_CALL_CLOSE}"


def tool_response_text(output: str) -> str:
    """The injected turn after a tool call: closes the assistant turn, answers as the user."""
    return (
        f"{IM_END}\n{IM_START}user\n{TOOL_RESPONSE_OPEN}\n{output}\n{TOOL_RESPONSE_CLOSE}{IM_END}\n"
        f"{IM_START}assistant\n"
    )


def answer_text(answer: str) -> str:
    return f"{ANSWER_OPEN}The answer is \\boxed{{{answer}}}{ANSWER_CLOSE}{IM_END}"


class ToolCallError(ValueError):
    """A tool call the model wrote that cannot be executed; its message goes back to the model."""


@dataclass(frozen=True)
class ToolCall:
    code: str
    stdin: str


def parse_tool_call(turn_text: str, tool_name: str) -> ToolCall:
    """Parse the last <tool_call>...</tool_call> of an assistant turn."""
    start = turn_text.rfind(TOOL_CALL_OPEN)
    end = turn_text.rfind(TOOL_CALL_CLOSE)
    if start < 0 or end < start:
        raise ToolCallError(f"no complete {TOOL_CALL_OPEN}...{TOOL_CALL_CLOSE} block")
    body = turn_text[start + len(TOOL_CALL_OPEN) : end].strip()
    try:
        payload = json.loads(body)
    except json.JSONDecodeError as exc:
        raise ToolCallError(f"tool call is not valid JSON: {exc}") from None
    if not isinstance(payload, dict):
        raise ToolCallError("tool call must be a JSON object with 'name' and 'arguments'")
    if payload.get("name") != tool_name:
        raise ToolCallError(f"unknown tool {payload.get('name')!r}; the only tool is {tool_name!r}")
    arguments = payload.get("arguments")
    if isinstance(arguments, str):  # some models double-encode the arguments
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError as exc:
            raise ToolCallError(f"tool call arguments are not valid JSON: {exc}") from None
    if not isinstance(arguments, dict) or not isinstance(arguments.get("code"), str):
        raise ToolCallError("tool call arguments must be an object with a string 'code'")
    stdin = arguments.get("input", "")
    if not isinstance(stdin, str):
        raise ToolCallError("tool call argument 'input' must be a string")
    return ToolCall(code=arguments["code"], stdin=stdin)


def truncate_middle(text: str, max_chars: int) -> str:
    """Keep both ends of a long tool output: errors show at the end, headers at the start."""
    if len(text) <= max_chars:
        return text
    marker = "\n...[truncated]...\n"
    keep = max(max_chars - len(marker), 0)
    head = keep // 2
    return text[:head] + marker + text[len(text) - (keep - head) :]
