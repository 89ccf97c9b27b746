"""The SFT data builder: chats from function-calling and instruction-following files rendered in
the exact rollout format, unusable chats set aside with their row ids, a chat without its question
or answer an error naming the file and row (or set aside too, when asked)."""

import json
import re
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from tasks.config import load_config
from tasks.data.chat_examples import chat_segments, chats_from_file
from tasks.data.sources import SourceError
from tasks.rollout.format import IM_END, IM_START, TOOL_CALL_CLOSE, TOOL_RESPONSE_OPEN, prompt_text, tool_response_text

TOOL = "execute_python_code_with_standard_io"
WEATHER = {
    "name": "get_weather",
    "description": "Current weather",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
}
CALL_CHAT = [
    {"role": "system", "content": "You are a bot with tools."},
    {"role": "user", "content": "Weather in Oslo?"},
    {
        "role": "assistant",
        "content": "",
        "tool_calls": [{"type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}],
    },
    {"role": "tool", "content": '{"temp_c": -3}'},
    {"role": "assistant", "content": "It is -3 C in Oslo."},
]


def test_a_function_calling_chat_in_the_rollout_format() -> None:
    segments = chat_segments(CALL_CHAT, [WEATHER], TOOL, "compact")
    assert [trainable for _, trainable in segments] == [False, True, False, True]
    prompt, call, response, final = (text for text, _ in segments)
    assert prompt == prompt_text("Weather in Oslo?", TOOL, "compact", [WEATHER])
    assert json.dumps(WEATHER) in prompt and "You are a bot" not in prompt  # our system prompt, their tools
    assert call == '<tool_call>{"name": "get_weather", "arguments": {"city": "Oslo"}}</tool_call>'
    assert response == tool_response_text('{"temp_c": -3}')
    assert final == "It is -3 C in Oslo." + IM_END


def test_an_instruction_chat_lists_the_python_tool_and_continues_turns() -> None:
    chat = [
        {"role": "user", "content": "Say hi."},
        {"role": "assistant", "content": "hi"},
        {"role": "user", "content": "Again."},
        {"role": "assistant", "content": "hi"},
    ]
    segments = chat_segments(chat, None, TOOL, "compact")
    assert segments[0][0] == prompt_text("Say hi.", TOOL, "compact")
    assert segments[2] == (f"\n{IM_START}user\nAgain.{IM_END}\n{IM_START}assistant\n", False)
    assert [t for _, t in segments] == [False, True, False, True]


@pytest.mark.parametrize(
    "chat, reason",
    [
        ([{"role": "assistant", "content": "hi"}], "must start with a user message"),
        (
            [{"role": "user", "content": "q"}, {"role": "assistant", "content": "<think>2+2</think>4"}],
            "reasoning trace",
        ),
        (
            [
                {"role": "user", "content": "q"},
                {
                    "role": "assistant",
                    "content": "",
                    "tool_calls": [{"name": "a", "arguments": {}}, {"name": "b", "arguments": {}}],
                },
                {"role": "tool", "content": "x"},
                {"role": "assistant", "content": "done"},
            ],
            "2 tool calls in one turn",
        ),
        (
            [{"role": "user", "content": "q"}, {"role": "tool", "content": "x"}, {"role": "assistant", "content": "a"}],
            "must answer an assistant tool call",
        ),
        ("not a list", "messages must be a list"),
    ],
)
def test_unusable_chats_say_why(chat, reason) -> None:
    with pytest.raises(ValueError, match=reason):
        chat_segments(chat, None, TOOL, "compact")


def test_chats_from_files_count_what_they_set_aside(tmp_path) -> None:
    path = tmp_path / "calls.jsonl"
    rows = [
        {"messages": CALL_CHAT, "tools": json.dumps([WEATHER])},  # tools as JSON text (xLAM style)
        {"messages": [{"role": "user", "content": "q"}]},  # no assistant answer
        {"conversation": []},
    ]  # no messages at all
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    examples, rejected = chats_from_file(
        "calls", "jsonl", path, "messages", "tools", None, TOOL, "compact", malformed="skip"
    )
    assert len(examples) == 1 and examples[0][1][0].endswith(TOOL_CALL_CLOSE)
    assert TOOL_RESPONSE_OPEN in examples[0][2][0]
    assert [(r.row_id, r.reason) for r in rejected] == [
        ("calls:1", "a chat must end with an assistant message that calls no tool"),
        ("calls:2", "no 'messages'"),
    ]
    parquet = tmp_path / "chats.parquet"
    pq.write_table(pa.Table.from_pylist([{"conversation": "x"}]), parquet)
    with pytest.raises(SourceError, match=r"chats\.parquet: no column 'messages'"):
        chats_from_file("c", "parquet", parquet, "messages", None, None, TOOL, "compact")


def test_a_chat_without_its_answer_is_an_error_naming_the_file_and_row(tmp_path) -> None:
    path = tmp_path / "chats.jsonl"
    rows = [
        {"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "<think>x</think>a"}]},
        {"messages": [{"role": "user", "content": "q"}]},
    ]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    # A reasoning trace (row 0) is left out by choice; a missing answer (row 1) is bad data.
    message = rf"^{re.escape(str(path))}, row 1: a chat must end with an assistant message .* \(messages\)"
    with pytest.raises(SourceError, match=message):
        chats_from_file("chats", "jsonl", path, "messages", None, None, TOOL, "compact")


def test_the_generated_set_is_the_default_source() -> None:
    cfg = load_config(Path(__file__).resolve().parents[1] / "configs" / "tiny.yaml")
    assert [(s.name, s.format) for s in cfg.sft.sources] == [("generated", "generated")]


def test_the_base_tokenizer_corpus_leaves_out_recovery_examples() -> None:
    from tasks.data.chat_examples import sft_examples

    cfg = load_config(Path(__file__).resolve().parents[1] / "configs" / "tiny.yaml", {"sft.n_examples": 50})
    assert cfg.sft.recovery_share > 0
    # A recovering example has six segments: prompt, failed call, error, call, output, answer.
    assert any(len(e) == 6 for e in sft_examples(cfg)[0])
    corpus, _ = sft_examples(cfg, recovery=False)
    assert len(corpus) == 50 and all(len(e) in (2, 4) for e in corpus)


def _ngrams(text: str, n: int = 8) -> set[tuple[str, ...]]:
    """Word n-grams with every number as one placeholder: a template shared with other numbers
    in it counts as overlap."""
    words = [re.sub(r"\d+", "0", w) for w in re.findall(r"\w+|[^\w\s]", text.lower())]
    return {tuple(words[i : i + n]) for i in range(len(words) - n + 1)}


def _example_text(example) -> str:
    """An example without its system prompt (every prompt, RL's too, has the same one)."""
    text = "".join(text for text, _ in example)
    return text.split(f"{IM_END}\n", 1)[1]


@pytest.mark.parametrize("mode", ["non_reasoning", "reasoning"])
def test_the_non_reasoning_set_shares_no_kind_and_no_8gram_with_the_rl_problems(mode) -> None:
    from tasks.data.chat_examples import sft_examples
    from tasks.data.problems import KINDS, generate_problems
    from tasks.data.tool_tasks import TOOL_TASKS

    cfg = load_config(Path(__file__).resolve().parents[1] / "configs" / "tiny.yaml", {"sft.mode": mode})
    assert not set(TOOL_TASKS) & set(KINDS)
    # The generated pool the train and held-out sets are split from: the problems as RL shows them.
    problems = generate_problems(cfg.data.n_train + cfg.data.n_heldout, cfg.data.levels, cfg.data.seed)
    rl_ngrams = set().union(*(_ngrams(p.question) for p in problems))
    examples, _ = sft_examples(cfg)
    shared = [e for e in examples if _ngrams(_example_text(e)) & rl_ngrams]
    if mode == "non_reasoning":
        assert not shared, _example_text(shared[0]) if shared else ""
    else:  # the check can see overlap: the reasoning arm is made of the RL kinds
        assert len(shared) > len(examples) // 2


def test_sft_replays_the_share_of_pre_training_documents_asked_for(tmp_path) -> None:
    from transformers import AutoTokenizer

    from tasks.data.chat_examples import sft_examples
    from tasks.data.problems import generate_problems
    from tasks.train.supervised import sft_samples
    from tasks.train.tiny_model import build_tiny_model

    cfg = load_config(Path("configs/tiny.yaml"), {"sft.n_examples": 60, "sft.replay_share": 0.25})
    corpus = [p.question + "\n" + p.solution_code for p in generate_problems(50, [1, 2], seed=0)]
    tokenizer = AutoTokenizer.from_pretrained(build_tiny_model(cfg.model.tiny, corpus, 0, tmp_path / "m"))
    examples = sft_examples(cfg)[0]
    samples = sft_samples(cfg, examples, tokenizer)
    replayed = [s for s in samples if all(s.loss_mask)]  # documents: every token a target
    kept = len(samples) - len(replayed)  # the examples that fit sft.max_len
    assert kept > 30 and len(replayed) == round(kept / 3)  # a quarter of all samples
    assert all(len(s.token_ids) == cfg.model.tiny.pretrain_seq_len for s in replayed)
    no_replay = cfg.model_copy(update={"sft": cfg.sft.model_copy(update={"replay_share": 0.0})})
    assert len(sft_samples(no_replay, examples, tokenizer)) == kept
