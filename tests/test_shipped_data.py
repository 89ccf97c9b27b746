"""The reference files in data/examples/ read through the real loaders, as a user's exported data
set would be: the layout data/README.md documents."""

from pathlib import Path

from tasks.data.chat_examples import chats_from_file
from tasks.data.filters import curate_rows
from tasks.data.sources import load_source

EXAMPLES = Path(__file__).resolve().parents[1] / "data" / "examples"
TOOL = "execute_python_code_with_standard_io"


def test_problem_file_loads_and_curation_keeps_the_integer_answers() -> None:
    rows, rejected = load_source("examples", "jsonl", EXAMPLES / "problems.jsonl", "problem", "answer", "id")
    assert [r.row_id for r in rows] == [f"examples:ex-{i}" for i in range(1, 6)] and rejected == []
    kept, removed, _ = curate_rows(rows, [], max_answer_digits=12, near_duplicate_threshold=0.85, ngram=8)
    assert {r.row_id: r.answer for r in kept} == {
        "examples:ex-1": "1",
        "examples:ex-2": "45",
        "examples:ex-3": "184756",
        "examples:ex-4": "9455",
    }
    assert [(r.row_id, r.stage) for r in removed] == [("examples:ex-5", "integer")]


def test_sft_chat_file_loads_in_the_rollout_format() -> None:
    examples, rejected = chats_from_file(
        "examples", "jsonl", EXAMPLES / "sft_chats.jsonl", "messages", "tools", None, TOOL, "schema"
    )
    assert rejected == [] and len(examples) == 2
    call_chat, answer_chat = examples
    assert [trainable for _, trainable in call_chat] == [False, True, False, True]
    assert "print(2**20)" in call_chat[1][0] and "1048576" in call_chat[2][0]
    assert [trainable for _, trainable in answer_chat] == [False, True]
