"""The rollout format (recipe.md section 2), the end-of-turn decisions of the agent loop, and
the SFT examples built in the same format.

Run: .venv/bin/python -m pytest tests/test_format.py -q
"""

import json

import pytest

from tasks.data.chat_examples import build_sft_examples
from tasks.data.problems import generate_problems, problem_statements, solve, split_problems
from tasks.records import RolloutSpec, ToolResult, ToolStatus, Trajectory
from tasks.rollout.agent import end_turn, render_tool_result
from tasks.rollout.format import (
    TOOL_CALL_CLOSE,
    ToolCall,
    ToolCallError,
    parse_tool_call,
    prompt_text,
    tool_call_text,
    tool_response_text,
    truncate_middle,
)

TOOL = "execute_python_code_with_standard_io"
SPEC = RolloutSpec(
    max_turns=3, max_response_tokens=100, temperature=1.0, top_p=1.0, tool_name=TOOL, tool_response_chars=40
)
CLOSE = 7  # a stand-in id for </tool_call>: end_turn only compares ids


def test_tool_call_round_trip():
    text = "Let me compute." + tool_call_text(TOOL, "print(input())", "5\n")
    assert parse_tool_call(text, TOOL) == ToolCall("print(input())", "5\n")


@pytest.mark.parametrize(
    "text, message",
    [
        ('<tool_call>{"name": "x", "arguments": {"code": "1"}', "no complete"),
        ("<tool_call>{not json}</tool_call>", "not valid JSON"),
        ('<tool_call>["a"]</tool_call>', "JSON object"),
        ('<tool_call>{"name": "python", "arguments": {"code": "1"}}</tool_call>', "unknown tool"),
        (f'<tool_call>{{"name": "{TOOL}", "arguments": {{"code": 3}}}}</tool_call>', "string 'code'"),
        (f'<tool_call>{{"name": "{TOOL}", "arguments": {{"code": "1", "input": 2}}}}</tool_call>', "'input'"),
    ],
)
def test_malformed_tool_calls_raise_a_readable_error(text, message):
    with pytest.raises(ToolCallError, match=message):
        parse_tool_call(text, TOOL)


def test_double_encoded_arguments_are_accepted():
    payload = json.dumps({"name": TOOL, "arguments": json.dumps({"code": "print(2)"})})
    assert parse_tool_call(f"<tool_call>{payload}</tool_call>", TOOL).code == "print(2)"


def test_truncate_middle_keeps_both_ends():
    text = "HEAD" + "x" * 1000 + "TAIL"
    cut = truncate_middle(text, 64)
    assert len(cut) <= 64 and cut.startswith("HEAD") and cut.endswith("TAIL") and "truncated" in cut
    assert truncate_middle("short", 64) == "short"


def test_tool_response_is_a_user_turn_then_the_assistant_resumes():
    text = tool_response_text("42")
    assert "<tool_response>\n42\n</tool_response>" in text
    assert text.startswith("<|im_end|>\n<|im_start|>user\n") and text.endswith("<|im_start|>assistant\n")


def test_prompt_lists_the_tool_and_opens_the_assistant_turn():
    text = prompt_text("What is 1+1?", TOOL)
    assert TOOL in text and "<tools>" in text and "\\boxed{}" in text
    assert text.endswith("<|im_start|>assistant\n")


def _traj():
    return Trajectory("p", 0, prompt_ids=[1, 2, 3])


def _end(traj: Trajectory, ids: list[int], text: str, finish_reason: str = "stop"):
    """end_turn with the engine's log-probs, one per generated token."""
    return end_turn(traj, ids, text, finish_reason, SPEC, CLOSE, [-0.5] * len(ids))


def test_end_turn_with_valid_call_returns_it():
    traj = _traj()
    action = _end(traj, [5, CLOSE], tool_call_text(TOOL, "print(1)"))
    assert action == ToolCall("print(1)", "") and traj.turns == 1 and traj.loss_mask == [1, 1]


def test_end_turn_with_bad_json_returns_the_parse_error():
    traj = _traj()
    action = _end(traj, [5, CLOSE], "<tool_call>{oops" + TOOL_CALL_CLOSE)
    assert isinstance(action, ToolCallError)
    assert traj.tool_calls[0].status is ToolStatus.PARSE_ERROR and traj.stop_reason == ""


def test_end_turn_without_answer_or_call_stops_with_no_answer():
    traj = _traj()
    assert _end(traj, [5, 6], "I do not know") is None
    assert traj.stop_reason == "no_answer"


def test_end_turn_runaway_length_stops_with_budget():
    traj = _traj()
    assert _end(traj, [5] * 100, "blah " * 100, "length") is None
    assert traj.stop_reason == "budget"


def test_end_turn_answer_and_max_turns():
    traj = _traj()
    assert _end(traj, [5], "<answer>\\boxed{2}</answer>") is None
    assert traj.stop_reason == "answer"
    traj = _traj()
    for _ in range(SPEC.max_turns - 1):
        assert _end(traj, [CLOSE], tool_call_text(TOOL, "1")) is not None
    assert _end(traj, [CLOSE], tool_call_text(TOOL, "1")) is None
    assert traj.stop_reason == "max_turns"


@pytest.mark.parametrize(
    "result, expected",
    [
        (ToolResult(ToolStatus.OK, stdout="4\n"), "4"),
        (ToolResult(ToolStatus.ERROR, stderr="Traceback...\nZeroDivisionError"), "ZeroDivisionError"),
        (ToolResult(ToolStatus.TIMEOUT), "TimeoutError"),
        (ToolResult(ToolStatus.PARSE_ERROR, stderr="tool call is not valid JSON"), "not valid JSON"),
    ],
)
def test_tool_results_are_rendered_for_the_model(result, expected):
    assert expected in render_tool_result(result, 200)


def test_problems_are_deterministic_and_answers_come_from_their_programs():
    first, second = generate_problems(60, [1, 2, 3], seed=3), generate_problems(60, [1, 2, 3], seed=3)
    assert first == second and len({p.problem_id for p in first}) == 60
    for problem in first:
        assert solve(problem.kind, problem.question, problem.solution_code) == problem.answer
        assert int(problem.answer) >= 0 or problem.answer.startswith("-")
    train, heldout = split_problems(first, 10, seed=0)
    assert len(heldout) == 10 and not {p.problem_id for p in train} & {p.problem_id for p in heldout}


def test_problem_statements_are_the_problems_unsolved():
    statements = list(problem_statements(40, [1, 2, 3], seed=4))
    problems = generate_problems(40, [1, 2, 3], seed=4)
    assert statements == [(p.kind, p.level, p.question, p.solution_code) for p in problems]


def test_a_last_or_first_digit_problem_passes_the_digit_limit_and_is_answered_right():
    import math
    import re

    kinds = ["last_digit", "last_digit_of_product", "first_digit"]
    for problem in generate_problems(60, [1, 2, 3], seed=3, kinds=kinds):
        powers = [(int(b), int(e)) for b, e in re.findall(r"(\d+)\^(\d+)", problem.question)]
        digits = sum(e * math.log10(b) for b, e in powers)
        assert digits > 4300 * problem.level, problem  # past the limit at every level
        if problem.kind == "first_digit":
            assert problem.answer == str(int(10 ** (digits % 1))), problem
        else:
            assert problem.answer == str(math.prod(pow(b, e, 10) for b, e in powers) % 10), problem


def test_problems_of_the_kinds_asked_for_and_unknown_kinds_named():
    import sys

    limit = sys.get_int_max_str_digits()
    problems = generate_problems(30, [1, 2, 3], seed=5, kinds=["digit_sum", "modular"])
    assert {p.kind for p in problems} == {"digit_sum", "modular"}
    assert sys.get_int_max_str_digits() == limit  # a solution lifts it in its own run only
    with pytest.raises(ValueError, match=r"data.kinds \['modulr'\]: each must be one of \[.*'modular'"):
        generate_problems(3, [1], seed=0, kinds=["modulr"])


def test_sft_examples_train_only_on_assistant_text():
    for example in build_sft_examples(20, [1, 2], seed=0, tool_name=TOOL):
        trainable = [text for text, flag in example if flag]
        masked = [text for text, flag in example if not flag]
        assert all("<tool_response>" not in text and "<|im_start|>system" not in text for text in trainable)
        assert trainable[-1].endswith("<|im_end|>")  # an answer block, or a chat's words
        assert masked[0].startswith("<|im_start|>system")


def test_recovery_examples_answer_a_real_error_and_train_only_the_correction():
    examples = build_sft_examples(40, [1, 2, 3], seed=0, tool_name=TOOL, recovery_share=0.5)
    recovering = [e for e in examples if len(e) == 6]
    assert len(recovering) == 16  # half of the 32 tool-call examples
    errors = set()
    for example in recovering:
        (_, _), (broken, broken_trained), (error, _), (fixed, fixed_trained), (_, _), (answer, _) = example
        assert not broken_trained and fixed_trained and broken != fixed
        assert parse_tool_call(fixed, TOOL).code
        reply = error.split("<tool_response>\n")[1].split("\n</tool_response>")[0].rstrip()
        try:
            parse_tool_call(broken, TOOL)
        except ToolCallError as exc:  # a malformed call, answered as the agent loop answers it
            assert reply == str(exc)
            errors.add("parse_error")
        else:  # a call of a failing program, answered with its traceback
            errors.add(reply.splitlines()[-1].split(":")[0])
        assert answer.startswith("<answer>")
    assert errors == {"parse_error", "NameError", "SyntaxError"}
    assert build_sft_examples(40, [1, 2, 3], seed=0, tool_name=TOOL) == build_sft_examples(
        40, [1, 2, 3], seed=0, tool_name=TOOL
    )
