"""Weight sync into a running vLLM engine: after an update and a sync, the engine's log-probs
equal the trainer's; before the sync they do not (so the check can fail).

Run: .venv/bin/python -m pytest tests/test_weight_sync.py -q   (about a minute)
"""

from pathlib import Path

import pytest

from tasks.config import EngineConfig, OptimConfig, TinyModelConfig
from tasks.data.problems import generate_problems
from tasks.rl.batch import Sample
from tasks.rollout.engine import Engine
from tasks.rollout.metrics import max_logprob_gap
from tasks.train.tiny_model import build_tiny_model
from tasks.train.trainer import Trainer

TOLERANCE = 2e-3  # fp32 on both sides; different kernels (vLLM CPU vs torch) differ ~1e-5


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    problems = generate_problems(64, [1, 2], seed=0)
    corpus = [p.question + "\n" + p.solution_code for p in problems]
    cfg = TinyModelConfig(hidden_size=128, num_layers=2, num_heads=2, num_kv_heads=1, intermediate_size=256)
    return build_tiny_model(cfg, corpus, seed=0, out_dir=tmp_path_factory.mktemp("model"))


def test_engine_log_probs_follow_the_trainer(model_dir):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    texts = [p.question + "\n" + p.solution_code for p in generate_problems(8, [1, 2], seed=1)]
    samples = [Sample(ids, [1] * len(ids), advantage=1.0) for ids in tokenizer(texts)["input_ids"]]
    engine = Engine(model_dir, EngineConfig(kv_cache_gib=0.05, max_model_len=256), seed=0).start()
    trainer = Trainer(model_dir, OptimConfig(lr=1e-2, warmup_steps=0, zero_stage=1, micro_batch_size=4), 10)
    sequences = [s.token_ids for s in samples]
    assert max_logprob_gap(engine.prompt_logprobs(sequences), trainer.token_logprobs(samples)) < TOLERANCE

    trainer.sft_step(samples)
    stale_gap = max_logprob_gap(engine.prompt_logprobs(sequences), trainer.token_logprobs(samples))
    assert stale_gap > 10 * TOLERANCE  # the update moved the policy: an unsynced engine shows it

    engine.load_weights(trainer.named_weights())
    assert max_logprob_gap(engine.prompt_logprobs(sequences), trainer.token_logprobs(samples)) < TOLERANCE
    engine.stop()
