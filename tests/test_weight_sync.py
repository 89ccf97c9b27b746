"""Weight sync into a running vLLM engine: after an update and a sync, the engine's log-probs
equal the trainer's; before the sync they do not (so the check can fail). Between the run's actors
(a trainer rank, two engine actors, over gloo and Ray's object store): tests/test_actor_faults.py.

Run: .venv/bin/python -m pytest tests/test_weight_sync.py -q   (about a minute)
"""

import pytest

from tasks.config import EnginesConfig, OptimConfig
from tasks.data.problems import generate_problems
from tasks.records import Sample
from tasks.rollout.engine import Engine
from tasks.rollout.metrics import max_logprob_gap
from tasks.train.trainer import Trainer

pytestmark = pytest.mark.slow  # starts engines or trains

# The same fp32 weights through two kernel sets (vLLM CPU vs torch): u = 6e-8 x 256-term dot products, ~9 in
# series, and x a 384-term log-sum-exp, ~2e-4 at worst here (~1e-3 for tiny.yaml's trained 4 x 512, 2048-token
# model); measured ~1e-5. The stale gaps it must sit far below come from Adam's first step, ~lr = 1e-2 a weight.
TOLERANCE = 2e-3


@pytest.mark.parametrize("eager", [True, False], ids=["eager", "compiled"])
def test_engine_log_probs_follow_the_trainer(model_dir, eager):
    """Also with torch.compile: a compiled graph must read the reloaded weights, not copies."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    texts = [p.question + "\n" + p.solution_code for p in generate_problems(8, [1, 2], seed=1)]
    samples = [Sample(ids, [1] * len(ids), advantage=1.0) for ids in tokenizer(texts)["input_ids"]]
    cfg = EnginesConfig(kv_cache_gib=0.05, max_model_len=256, enforce_eager=eager)
    engine = Engine(model_dir, cfg, seed=0).start()
    trainer = Trainer(model_dir, OptimConfig(lr=1e-2, warmup_steps=0, micro_batch_size=4), 10, zero_stage=1)
    sequences = [s.token_ids for s in samples]
    assert max_logprob_gap(engine.prompt_logprobs(sequences), trainer.token_logprobs(samples)) < TOLERANCE

    trainer.sft_step(samples)
    stale_gap = max_logprob_gap(engine.prompt_logprobs(sequences), trainer.token_logprobs(samples))
    assert stale_gap > 10 * TOLERANCE  # the update moved the policy: an unsynced engine shows it

    engine.load_weights(trainer.named_weights(), version=1)
    assert max_logprob_gap(engine.prompt_logprobs(sequences), trainer.token_logprobs(samples)) < TOLERANCE
    engine.stop()


def test_no_turn_after_a_push_reuses_keys_and_values_of_the_old_weights(model_dir):
    """The prefix cache is fenced per policy version: a prompt drawn from before a push is served
    after it with keys and values of the new weights. Without the fence (the reload alone, the
    control) the same turn is scored by the old weights' cached prompt."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    texts = [p.question + "\n" + p.solution_code for p in generate_problems(4, [1, 2], seed=6)]
    prompts = [ids[:96] for ids in tokenizer(texts)["input_ids"]]  # whole KV blocks: cached
    engine = Engine(model_dir, EnginesConfig(kv_cache_gib=0.05, max_model_len=256), seed=0).start()
    trainer = Trainer(model_dir, OptimConfig(lr=1e-2, warmup_steps=0, micro_batch_size=4), 10, zero_stage=1)

    def turn_gap() -> float:
        """Draw a turn after each prompt (the prompt's KV cached from the turn before, if any)
        and compare its sampling log-probs with the trainer's."""
        for index, prompt in enumerate(prompts):
            engine.add_request(str(index), prompt, max_tokens=8, temperature=1.0, top_p=1.0, stop_token_ids=[])
        turns = []
        while engine.has_unfinished():
            turns += engine.step()
        turns.sort(key=lambda turn: int(turn.request_id))
        assert {turn.weights_version for turn in turns} == {engine.weights_version}  # stamped as loaded
        samples = [Sample(p + t.token_ids, [1] * (len(p) + len(t.token_ids))) for p, t in zip(prompts, turns)]
        views = trainer.token_logprobs(samples)
        return max(abs(a - b) for p, t, v in zip(prompts, turns, views) for a, b in zip(t.logprobs, v[len(p) - 1 :]))

    assert turn_gap() < TOLERANCE  # the same weights; the prompts' KV is now cached
    trainer.sft_step([Sample(p, [1] * len(p), advantage=1.0) for p in prompts])
    engine.load_weights(trainer.named_weights(), version=1)
    fenced = turn_gap()
    assert engine.weights_version == 1
    trainer.sft_step([Sample(p, [1] * len(p), advantage=1.0) for p in prompts])
    worker = engine._core.engine_core.engine_core.model_executor.driver_worker.worker
    worker.reload_weights(weights_iterator=iter(trainer.named_weights()), is_checkpoint_format=True)
    unfenced = turn_gap()  # the cached prompts were computed by the previous version
    engine.stop()
    print(f"largest turn log-prob gap after a push: fenced {fenced:.1e}, without the fence {unfenced:.1e}")
    assert fenced < TOLERANCE < 10 * TOLERANCE < unfenced


def test_the_engines_sampling_log_probs_are_the_trainers_at_the_temperature(model_dir):
    """What importance weighting reads as the behaviour policy: with the same weights, the
    log-probs the engine sampled its tokens with are the trainer's at the sampling temperature,
    so the weights min(pi_trainer / pi_engine, cap) are 1 up to kernel differences."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    prompts = tokenizer([p.question + "\n" for p in generate_problems(6, [1, 2], seed=4)])["input_ids"]
    engine = Engine(model_dir, EnginesConfig(kv_cache_gib=0.05, max_model_len=256), seed=0).start()
    for index, prompt in enumerate(prompts):
        engine.add_request(str(index), prompt, max_tokens=24, temperature=0.7, top_p=1.0, stop_token_ids=[])
    turns = []
    while engine.has_unfinished():
        turns += engine.step()
    engine.stop()
    trainer = Trainer(model_dir, OptimConfig(micro_batch_size=4), 10, zero_stage=1)
    turns.sort(key=lambda turn: int(turn.request_id))
    samples = [
        Sample(prompt + turn.token_ids, [1] * (len(prompt) + len(turn.token_ids)))
        for prompt, turn in zip(prompts, turns)
    ]
    trained = trainer.token_logprobs(samples, temperature=0.7)
    gaps = [
        abs(engine_lp - trainer_lp)
        for prompt, turn, view in zip(prompts, turns, trained)
        for engine_lp, trainer_lp in zip(turn.logprobs, view[len(prompt) - 1 :])
    ]
    assert all(len(turn.logprobs) == len(turn.token_ids) > 0 for turn in turns)
    assert len(gaps) == sum(len(turn.token_ids) for turn in turns) and max(gaps) < TOLERANCE, max(gaps)
    print(f"behaviour log-probs against the trainer's at temperature 0.7: max gap {max(gaps):.1e}, {len(gaps)} tokens")
    # At temperature 1 the trainer's view differs: the engine's are the tempered ones.
    untempered = trainer.token_logprobs(samples)
    assert (
        max(
            abs(a - b)
            for turn, view, prompt in zip(turns, untempered, prompts)
            for a, b in zip(turn.logprobs, view[len(prompt) - 1 :])
        )
        > 10 * TOLERANCE
    )
