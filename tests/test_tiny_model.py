"""The embedded default model: deterministic from the seed, a Hugging Face directory whose
tokenizer keeps the format's tags and the tool's name whole and splits numbers into digits.

Run: .venv/bin/python -m pytest tests/test_tiny_model.py -q
"""

import pytest
from transformers import AutoModelForCausalLM, AutoTokenizer

from tasks.config import TinyModelConfig
from tasks.data.problems import generate_problems
from tasks.rollout.format import IM_END, TAG_TOKENS, tool_call_text

CFG = TinyModelConfig(hidden_size=64, num_layers=2, num_heads=1, num_kv_heads=1, intermediate_size=128)
CORPUS = [p.question + "\n" + p.solution_code for p in generate_problems(200, [1, 2, 3], seed=0)]


def _build(path, seed=0, cfg=CFG):
    from tasks.train.tiny_model import build_tiny_model

    return build_tiny_model(cfg, CORPUS, seed, path)


def test_same_seed_same_files(tmp_path):
    first, second = _build(tmp_path / "a"), _build(tmp_path / "b")
    for name in ("model.safetensors", "tokenizer.json", "config.json"):
        assert (first / name).read_bytes() == (second / name).read_bytes(), name
    assert (_build(tmp_path / "c", seed=1) / "model.safetensors").read_bytes() != (
        first / "model.safetensors"
    ).read_bytes()


@pytest.mark.parametrize("architecture, model_class", [("qwen3", "Qwen3ForCausalLM"), ("qwen2", "Qwen2ForCausalLM")])
def test_loads_as_a_qwen_causal_lm_with_untied_embeddings(tmp_path, architecture, model_class):
    model = AutoModelForCausalLM.from_pretrained(
        _build(tmp_path / "m", cfg=CFG.model_copy(update={"architecture": architecture}))
    )
    assert type(model).__name__ == model_class and not model.config.tie_word_embeddings
    tokenizer = AutoTokenizer.from_pretrained(tmp_path / "m")
    assert model.config.vocab_size >= len(tokenizer) and tokenizer.eos_token == IM_END


def test_tags_and_the_tool_name_are_single_tokens_and_digits_split(tmp_path):
    tokenizer = AutoTokenizer.from_pretrained(_build(tmp_path / "m"))
    for tag in [*TAG_TOKENS, "execute_python_code_with_standard_io"]:
        assert len(tokenizer(tag, add_special_tokens=False)["input_ids"]) == 1, tag
    pieces = tokenizer.convert_ids_to_tokens(tokenizer("x = 40961", add_special_tokens=False)["input_ids"])
    assert pieces[-5:] == ["4", "0", "9", "6", "1"]
    text = tool_call_text("execute_python_code_with_standard_io", "print(2 ** 10)")
    assert tokenizer.decode(tokenizer(text, add_special_tokens=False)["input_ids"]) == text


def test_pretraining_starts_with_copy_drills_then_problems(tmp_path):
    from tasks.data.pretrain import copy_documents, pretraining_phases

    for document in copy_documents(50, seed=1):
        prompt, numbers, rest = document.split("\n")
        assert prompt == "Repeat: " + numbers and rest == "" and 1 <= len(numbers.split()) <= 4
    tokenizer = AutoTokenizer.from_pretrained(_build(tmp_path / "m"))
    tiny = CFG.model_copy(
        update={"pretrain_steps": 10, "pretrain_copy_share": 0.3, "pretrain_batch_size": 2, "pretrain_seq_len": 32}
    )
    (drills, drill_steps), (problems, problem_steps) = pretraining_phases(tokenizer, tiny, [1, 2], seed=0)
    assert (drill_steps, problem_steps) == (3, 7)
    assert all(len(s.token_ids) == 32 and all(s.loss_mask) for s in drills + problems)
    assert "Repeat:" in tokenizer.decode(drills[0].token_ids)
    assert any("print(" in tokenizer.decode(s.token_ids) for s in problems)
    no_drills = tiny.model_copy(update={"pretrain_copy_share": 0.0})
    assert [steps for _, steps in pretraining_phases(tokenizer, no_drills, [1, 2], seed=0)] == [10]


def test_epoch_batches_cover_each_sample_once_per_epoch():
    from tasks.train.supervised import epoch_batches

    batches = list(epoch_batches(list(range(10)), batch_size=3, steps=7, seed=0))
    assert len(batches) == 7 and all(len(b) == 3 for b in batches)
    assert sorted(sum(batches[:3], [])) == sorted(set(sum(batches[:3], [])))  # 3 batches per epoch, no repeats
