"""Rollouts over a real pool of two vLLM engine processes, under each scheduler policy.

The model is untrained, so every turn runs to the token budget: long, same-length rollouts on
engines whose KV cache holds only a few of them. The static split overflows the cache (vLLM
preempts and recomputes); the KV-aware scheduler admits only what fits and never does.
About a minute on two cores.
"""

from pathlib import Path

import pytest
import torch
from transformers import AutoTokenizer

from tasks.config import EngineConfig
from tasks.data.problems import generate_problems
from tasks.rollout.agent import ToolRunner, run_rollouts
from tasks.rollout.engine import available_cores
from tasks.rollout.pool import EnginePool, engine_cores
from tasks.rollout.trajectory import RolloutSpec
from tasks.sandbox.executor import Limits
from tasks.sandbox.server import SandboxService

SPEC = RolloutSpec(
    max_turns=2,
    max_response_tokens=120,
    temperature=1.0,
    top_p=1.0,
    tool_name="execute_python_code_with_standard_io",
    tool_response_chars=200,
    tool_spec="compact",
)
# ~780 tokens of KV per engine: two ~330-token prompts fit, their growth does not
# (128 hidden, 2 layers, 1 KV head of 64, fp32: 1 KiB a token).
ENGINES = EngineConfig(kv_cache_gib=0.00075, max_model_len=512, block_size=32, count=2)


def test_engines_get_their_own_blocks_of_cores() -> None:
    cores = [0, 1, 2, 3, 4, 5]
    assert [engine_cores(i, 1, cores) for i in range(3)] == [[0], [1], [2]]
    assert [engine_cores(i, 2, cores) for i in range(3)] == [[0, 1], [2, 3], [4, 5]]
    # More engines x threads than cores: they wrap around and share.
    assert [engine_cores(i, 1, [4, 7]) for i in range(3)] == [[4], [7], [4]]
    assert engine_cores(0, 8, [0, 1]) == [0, 1]


@pytest.mark.slow
def test_an_engine_in_this_process_runs_engine_threads(model_dir) -> None:
    previous = torch.get_num_threads()
    try:
        with EnginePool(model_dir, ENGINES.model_copy(update={"count": 1, "threads": 2}), seed=0) as pool:
            assert pool.stats()[0]["threads"] == 2
    finally:
        torch._C.set_num_threads(previous)


@pytest.fixture(scope="module")
def services(model_dir):
    with (
        SandboxService(workers=2, limits=Limits(timeout_s=2.0)) as box,
        ToolRunner([box.url]) as tools,
        EnginePool(model_dir, ENGINES, seed=0) as pool,
    ):
        yield pool, tools


@pytest.mark.parametrize("policy", ["static", "kv_aware", "kv_observed"])
@pytest.mark.slow
def test_rollouts_complete_on_a_two_engine_pool(model_dir, services, policy) -> None:
    pool, tools = services
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    problems = [(p.problem_id, p.question) for p in generate_problems(4, [1], seed=3)]
    # kv_observed: as if the previous batch's rollouts had held 200 tokens each.
    reserve, previous = ("observed", [200] * 8) if policy == "kv_observed" else ("max_length", [])
    pool.cfg = pool.cfg.model_copy(
        update={"scheduler": policy.replace("kv_observed", "kv_aware"), "kv_reserve": reserve}
    )
    pool.last_rollout_sizes = previous
    trajectories, times = run_rollouts(pool, tools, tokenizer, problems, 4, SPEC)
    assert len(trajectories) == 16
    for traj in trajectories:
        assert traj.stop_reason, traj
        assert len(traj.response_ids) == len(traj.loss_mask) <= SPEC.max_response_tokens
    assert 0.0 <= times.engine_idle_fraction < 1.0, times
    longest = max(len(t.prompt_ids) for t in trajectories) + SPEC.max_response_tokens
    slots = [kv // longest for kv in pool.kv_tokens]
    assert min(slots) >= 1 and sum(slots) < 16, (pool.kv_tokens, longest)  # the pool cannot hold all at once
    assert all(t.stop_reason != "budget" or len(t.response_ids) > 0 for t in trajectories)
    if policy == "kv_observed":
        assert times.kv_reserve_tokens == 260  # 1.3 x 200, so more rollouts than full-length fit
    elif policy == "kv_aware":
        assert times.kv_reserve_tokens == longest
        assert times.preemptions == 0
    else:
        assert times.preemptions > 0, (
            [(t.stop_reason, len(t.response_ids), len(t.prompt_ids)) for t in trajectories],
            pool.kv_tokens,
        )


@pytest.mark.slow
def test_each_engine_process_runs_on_its_own_cores(services) -> None:
    pool, _ = services
    for index, stats in enumerate(pool.stats()):
        assert stats["threads"] == ENGINES.threads == 1
        assert stats["cores"] == engine_cores(index, 1, available_cores()), (index, stats)


@pytest.mark.slow
def test_evaluation_samples_differ_at_temperature_0_6(model_dir, services) -> None:
    """avg@k needs k real samples: the release evaluated greedily, which makes avg@16 one sample."""
    from tasks.config import load_config
    from tasks.rollout.trajectory import rollout_spec

    cfg = load_config(Path(__file__).resolve().parents[1] / "configs" / "tiny.yaml")
    spec = rollout_spec(cfg.rollout, cfg.eval.model_copy(update={"max_response_tokens": 48}))
    assert spec.temperature == 0.6
    pool, tools = services
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    problems = [(p.problem_id, p.question) for p in generate_problems(3, [1], seed=5)]
    trajectories, _ = run_rollouts(pool, tools, tokenizer, problems, 4, spec)
    for problem_id, _ in problems:
        responses = [tuple(t.response_ids) for t in trajectories if t.problem_id == problem_id]
        assert len(responses) == 4 and len(set(responses)) == 4, problem_id
