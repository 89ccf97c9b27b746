"""The embedded default model: deterministic from the seed, a Hugging Face directory whose
tokenizer keeps the format's tags and the tool's name whole and splits numbers into digits.

Run: .venv/bin/python -m pytest tests/test_tiny_model.py -q
"""

import json
import re

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


def test_copy_drills_and_their_probe(tmp_path):
    from tasks.data.pretrain import copy_documents, copy_drill_samples, copy_probe_samples

    for document in copy_documents(50, seed=1):
        prompt, numbers, rest = document.split("\n")
        assert prompt == "Repeat: " + numbers and rest == "" and 1 <= len(numbers.split()) <= 4
    tokenizer = AutoTokenizer.from_pretrained(_build(tmp_path / "m"))
    tiny = CFG.model_copy(update={"pretrain_copy_steps": 3, "pretrain_batch_size": 2, "pretrain_seq_len": 32})
    drills = copy_drill_samples(tokenizer, tiny, seed=0)
    assert len(drills) >= 3 * 2 and all(len(s.token_ids) == 32 and all(s.loss_mask) for s in drills)
    assert "Repeat:" in tokenizer.decode(drills[0].token_ids)
    for sample in copy_probe_samples(tokenizer, 20, seed=3):
        text = tokenizer.decode(sample.token_ids)
        target = tokenizer.decode([t for t, m in zip(sample.token_ids, sample.loss_mask) if m])
        copy = target.removesuffix("\n")
        assert text == f"Repeat: {copy}\n{target}" and target == copy + "\n"  # the copy and where it ends


@pytest.mark.parametrize("layout", ["plain", "tool_call", "user_turn", "chat", "fix"])
def test_pretraining_documents_in_each_layout(layout):
    from tasks.config import PretrainLayouts
    from tasks.data.pretrain import pretraining_documents
    from tasks.data.problems import DIGIT_LIMIT_OFF, RECURSION_LIMIT_OFF

    names = ("plain", "tool_call", "user_turn", "chat", "fix")
    documents = pretraining_documents(
        30, [1, 2], 5, PretrainLayouts(**{n: float(n == layout) for n in names}), "run_python", "compact"
    )
    assert len(documents) == 30
    for document in documents:
        assert ("<|im_start|>system" in document) == (layout == "chat")
        assert ("<tool_call>" in document) == (layout != "plain")
    if layout == "fix":  # the unguarded call, its real error, the guarded call; no output or answer
        errors = {
            DIGIT_LIMIT_OFF: "use sys.set_int_max_str_digits() to increase the limit",
            RECURSION_LIMIT_OFF: "RecursionError: maximum recursion depth exceeded",
        }
        guards = set()
        for document in documents:
            first, fixed = (
                json.loads(call)["arguments"]["code"] for call in re.findall("<tool_call>(.*?)</tool_call>", document)
            )
            guard = fixed.removesuffix(first)
            error = document.split("<tool_response>\n")[1].split("\n</tool_response>")[0]
            assert fixed == guard + first and error.endswith(errors[guard])
            assert document.count("<tool_response>") == 1 and "boxed" not in document
            guards.add(guard)
        assert guards == set(errors)
    if layout == "user_turn":  # the rollout's turns without a system prompt, a tool response or an answer
        assert all(d.startswith("<|im_start|>user\n") and d.endswith("</tool_call><|im_end|>\n") for d in documents)
        assert not any("<tool_response>" in d or "boxed" in d for d in documents)
    if layout == "chat":  # tool tasks (never RL kinds: tests/test_sft_data.py), the whole transcript
        assert all(d.count("<tool_response>") == 1 and "The answer is \\boxed{" in d for d in documents)


def test_pretraining_shows_the_digit_kinds_programs_unguarded_the_share_asked_for():
    from tasks.config import PretrainLayouts
    from tasks.data.pretrain import pretraining_documents
    from tasks.data.problems import DIGIT_LIMIT_OFF, RECURSION_LIMIT_OFF

    def guarded_share(share: float) -> float:
        documents = pretraining_documents(1200, [1, 2, 3], 5, PretrainLayouts(), "run_python", "compact", share)
        digit_programs = [d for d in documents if "digit" in d.partition("\n")[0]]
        assert len(digit_programs) > 400  # 5 of the 12 kinds
        recursions = [d for d in documents if "def a(n)" in d]
        assert recursions and not any(RECURSION_LIMIT_OFF in d for d in recursions)  # raised after its error only
        return sum(DIGIT_LIMIT_OFF in d for d in digit_programs) / len(digit_programs)

    assert guarded_share(0.0) == 1.0
    assert abs(guarded_share(0.7) - 0.3) < 0.06  # 3 binomial standard deviations of ~460 draws


def test_epoch_batches_cover_each_sample_once_per_epoch():
    from tasks.train.supervised import epoch_batches

    batches = list(epoch_batches(list(range(10)), batch_size=3, steps=7, seed=0))
    assert len(batches) == 7 and all(len(b) == 3 for b in batches)
    assert sorted(sum(batches[:3], [])) == sorted(set(sum(batches[:3], [])))  # 3 batches per epoch, no repeats


# Unseen drills greedy-copied: the check ends the drills at its first pass, so the share it saw
# is at or above the model's (the largest of noisy checks); UNSEEN_FLOOR lies 3 binomial standard
# deviations of 64 draws (0.06 at 0.4) below 0.4.
UNSEEN, UNSEEN_FLOOR = 64, 0.2


@pytest.mark.soak
def test_the_default_base_model_forms_copying_within_its_drill_budget(tmp_path):
    """The default's copy drills, as `make run` trains them, until copying forms, and greedy
    decoding of unseen drills. `make test` checks the same on the default run it shares
    (tests/test_learning.py); this one, about 6 minutes on two cores, is scripts/other_cpus.sh's:
    `-m soak` runs it."""
    import torch

    from tasks.config import default_config_path, load_config
    from tasks.data.pretrain import copy_documents
    from tasks.train.supervised import build_base_model

    cfg = load_config(default_config_path(), {"model.tiny.pretrain_steps": 0})
    tiny = cfg.model.tiny
    logged: dict[str, list[float]] = {}
    model_dir, steps = build_base_model(
        cfg,
        generate_problems(cfg.data.n_train, cfg.data.levels, cfg.data.seed),
        tmp_path / "base",
        lambda metrics, step: [logged.setdefault(k, []).append(v) for k, v in metrics.items()],
    )
    curve = logged["pretrain/copy_exact"]
    assert steps < tiny.pretrain_copy_steps, f"copying never formed in {steps} drill steps: {curve}"
    assert curve[-1] >= tiny.pretrain_copy_until
    # The check is teacher-forced on the copy and its newline: the share greedy decoding copies.
    # Here greedy decoding itself, on drills from a seed neither the drills nor the check drew from.
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    exact = 0
    for document in copy_documents(UNSEEN, seed=12345):
        prompt, _, copy = document.rstrip("\n").rpartition("\n")
        ids = tokenizer(prompt + "\n", return_tensors="pt").input_ids
        with torch.no_grad():  # room for the longest copy (4 numbers of 8 digits: 35 tokens) and more
            out = model.generate(ids, max_new_tokens=48, do_sample=False, pad_token_id=tokenizer.pad_token_id)
        exact += tokenizer.decode(out[0, ids.shape[1] :]).split("\n")[0] == copy
    print(f"copying formed by step {steps}: the check {curve[-1]:.2f}, greedy on unseen drills {exact}/{UNSEEN}")
    assert exact / UNSEEN >= UNSEEN_FLOOR, f"greedy copies exact {exact}/{UNSEEN}"
