"""Weight sync into a running vLLM engine: after an update and a sync, the engine's log-probs
equal the trainer's; before the sync they do not (so the check can fail).

Run: .venv/bin/python -m pytest tests/test_weight_sync.py -q   (about a minute)
"""

import pytest

from tasks.config import EngineConfig, OptimConfig
from tasks.data.problems import generate_problems
from tasks.rollout.engine import Engine
from tasks.rollout.metrics import max_logprob_gap
from tasks.train.sample import Sample
from tasks.train.trainer import Trainer

pytestmark = pytest.mark.slow  # starts engines or trains

TOLERANCE = 2e-3  # fp32 on both sides; different kernels (vLLM CPU vs torch) differ ~1e-5


@pytest.mark.parametrize("eager", [True, False], ids=["eager", "compiled"])
def test_engine_log_probs_follow_the_trainer(model_dir, eager):
    """Also with torch.compile: a compiled graph must read the reloaded weights, not copies."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    texts = [p.question + "\n" + p.solution_code for p in generate_problems(8, [1, 2], seed=1)]
    samples = [Sample(ids, [1] * len(ids), advantage=1.0) for ids in tokenizer(texts)["input_ids"]]
    cfg = EngineConfig(kv_cache_gib=0.05, max_model_len=256, enforce_eager=eager)
    engine = Engine(model_dir, cfg, seed=0).start()
    trainer = Trainer(model_dir, OptimConfig(lr=1e-2, warmup_steps=0, zero_stage=1, micro_batch_size=4), 10)
    sequences = [s.token_ids for s in samples]
    assert max_logprob_gap(engine.prompt_logprobs(sequences), trainer.token_logprobs(samples)) < TOLERANCE

    trainer.sft_step(samples)
    stale_gap = max_logprob_gap(engine.prompt_logprobs(sequences), trainer.token_logprobs(samples))
    assert stale_gap > 10 * TOLERANCE  # the update moved the policy: an unsynced engine shows it

    engine.load_weights(trainer.named_weights())
    assert max_logprob_gap(engine.prompt_logprobs(sequences), trainer.token_logprobs(samples)) < TOLERANCE
    engine.stop()


def test_every_engine_of_a_pool_follows_the_trainer(model_dir):
    """Two engines in worker processes: a sync reaches both, and each one's log-probs match."""
    from transformers import AutoTokenizer

    from tasks.rollout.pool import EnginePool

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    texts = [p.question + "\n" + p.solution_code for p in generate_problems(4, [1, 2], seed=2)]
    samples = [Sample(ids, [1] * len(ids), advantage=1.0) for ids in tokenizer(texts)["input_ids"]]
    sequences = [s.token_ids for s in samples]
    trainer = Trainer(model_dir, OptimConfig(lr=1e-2, warmup_steps=0, zero_stage=1, micro_batch_size=4), 10)
    cfg = EngineConfig(kv_cache_gib=0.05, max_model_len=256, count=2)
    with EnginePool(model_dir, cfg, seed=0) as pool:
        assert len(pool.kv_tokens) == 2 and min(pool.kv_tokens) > 0
        trainer.sft_step(samples)
        stale = [max_logprob_gap(view, trainer.token_logprobs(samples)) for view in pool.prompt_logprobs(sequences)]
        assert min(stale) > 10 * TOLERANCE
        pool.load_weights(trainer.named_weights())
        synced = [max_logprob_gap(view, trainer.token_logprobs(samples)) for view in pool.prompt_logprobs(sequences)]
        assert max(synced) < TOLERANCE, synced
