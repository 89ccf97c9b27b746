"""The rollout scheduler policies (pure) and the paper-scale simulator that drives them."""

import sys
from pathlib import Path

import pytest

from tasks.records import TurnTrace
from tasks.rollout.scheduler import (
    KVAwareScheduler,
    StaticScheduler,
    make_scheduler,
    reserve_tokens,
)

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))

import scheduler_sim  # noqa: E402


def test_kv_aware_admits_what_each_engine_can_hold_at_full_length() -> None:
    # 10,000 and 25,000 KV tokens, rollouts of up to 4,000 tokens: 2 and 6 slots.
    scheduler = KVAwareScheduler([10_000, 25_000], 4_000, range(20))
    started = scheduler.admit()
    per_engine = [sum(1 for _, e in started if e == engine) for engine in (0, 1)]
    assert per_engine == [2, 6]
    assert [r for r, _ in started] == list(range(8))  # first come, first served
    assert scheduler.admit() == []  # full: nothing more until a rollout ends


def test_kv_aware_admits_the_next_rollout_the_moment_one_finishes() -> None:
    scheduler = KVAwareScheduler([8_000, 8_000], 4_000, range(6))
    engine_of = dict(scheduler.admit())
    assert len(engine_of) == 4
    scheduler.finish(2)
    assert scheduler.admit() == [(4, engine_of[2])]
    scheduler.finish(0)
    scheduler.finish(1)
    assert sorted(e for _, e in scheduler.admit()) == [engine_of[0]]  # one rollout was left
    assert scheduler.admit() == []


def test_kv_aware_fills_the_engine_with_most_free_slots_first() -> None:
    scheduler = KVAwareScheduler([4_000] * 3, 1_000, range(3))
    assert sorted(e for _, e in scheduler.admit()) == [0, 1, 2]


def test_kv_aware_rejects_an_engine_too_small_for_one_rollout() -> None:
    with pytest.raises(ValueError, match="engine 1 has a KV cache of 3000 tokens"):
        KVAwareScheduler([8_000, 3_000], 4_000, range(4))


def test_reserve_is_the_full_length_or_headroom_times_the_observed_mean() -> None:
    assert reserve_tokens("max_length", 8_000, [1_000, 3_000]) == 8_000
    assert reserve_tokens("observed", 8_000, []) == 8_000  # nothing seen yet: the safe reserve
    assert reserve_tokens("observed", 8_000, [1_000, 3_000]) == 2_600  # 1.3 x 2,000
    assert reserve_tokens("observed", 8_000, [1_000, 3_000], headroom=1.0) == 2_000
    assert reserve_tokens("observed", 8_000, [9_000, 9_000]) == 8_000  # never past the most
    # The smaller reserve is what lets an engine hold more rollouts at once.
    assert len(KVAwareScheduler([26_000], 2_600, range(20)).admit()) == 10
    assert len(KVAwareScheduler([26_000], 8_000, range(20)).admit()) == 3


def test_reserve_rejects_unknown_modes_and_headroom_below_one() -> None:
    with pytest.raises(ValueError, match="unknown KV reserve 'p90'"):
        reserve_tokens("p90", 8_000, [1_000])
    with pytest.raises(ValueError, match="headroom must be at least 1, got 0.5"):
        reserve_tokens("observed", 8_000, [1_000], headroom=0.5)


def test_static_splits_everything_evenly_up_front() -> None:
    scheduler = StaticScheduler(3, range(7))
    started = scheduler.admit()
    assert [e for _, e in started] == [0, 1, 2, 0, 1, 2, 0]
    assert scheduler.admit() == []


def test_unknown_policy_is_named() -> None:
    with pytest.raises(ValueError, match="unknown scheduler policy 'fifo'"):
        make_scheduler("fifo", [1000], 100, range(3))


def test_simulation_finishes_every_rollout_and_kv_aware_never_evicts() -> None:
    args = type(
        "Args",
        (),
        dict(
            prompts=16,
            samples=8,
            max_response=4096,
            max_turns=5,
            turn_median=600,
            tool_latencies=None,
            seed=1,
            engines=4,
            kv_headroom=1.3,
        ),
    )
    tight = scheduler_sim.Hardware(kv_tokens=40_000)
    static = scheduler_sim.simulate("static", args, tight)
    kv_aware = scheduler_sim.simulate("kv_aware", args, tight)
    assert static["preemptions"] + static["prefix_evictions"] > 0
    assert static["recomputed_tokens"] > 0
    assert (kv_aware["preemptions"], kv_aware["prefix_evictions"]) == (0, 0)
    assert kv_aware["recomputed_tokens"] == 0
    observed = scheduler_sim.simulate("kv_aware", args, tight, reserve="observed")
    assert observed["slots_per_engine"] > kv_aware["slots_per_engine"]
    assert (observed["preemptions"], observed["prefix_evictions"]) == (0, 0)
    assert observed["makespan_s"] < kv_aware["makespan_s"]  # bigger batches, same engines
    for result in (static, kv_aware, observed):
        assert result["makespan_s"] > 0 and 0 <= result["idle_fraction"] < 1


def test_a_replayed_trace_costs_its_prefills_steps_and_tool_waits() -> None:
    # One rollout on one engine: a 100-token prompt, 5 tokens, a tool answering in 0.5 s whose
    # response (with its template) adds 10 tokens, then 3 tokens. 1 ms a prefilled token, 10 ms a
    # step: (0.100 + 5 x 0.010) + 0.5 + (0.010 + 3 x 0.010) = 0.69 s.
    traces = [
        TurnTrace(0, context_tokens=100, added_tokens=100, generated_tokens=5, started_at=0.0, ended_at=1.0,
                  tool_latency_s=0.5, tool_response_tokens=8),
        TurnTrace(0, context_tokens=115, added_tokens=10, generated_tokens=3, started_at=1.6, ended_at=2.0),
    ]  # fmt: skip
    record = scheduler_sim.replay_record(traces)
    assert record == [100, [5, 3], [[10, 0.5]]]
    hw = scheduler_sim.Hardware(
        kv_tokens=10_000, step_base_s=0.01, step_per_seq_s=0.0, step_per_context_token_s=0.0,
        prefill_per_token_s=0.001, max_chunk_steps=1,
    )  # fmt: skip
    for scheduler in ("static", "kv_aware"):
        run = {"scheduler": scheduler, "reserve": 200, "rollouts": [record]}
        assert scheduler_sim.replayed(run, 1, hw)["makespan_s"] == pytest.approx(0.69)
    # A malformed call answered without the sandbox waits on nothing.
    traces[0].tool_latency_s = None
    assert scheduler_sim.replay_record(traces)[2] == [[10, 0.0]]


def test_kv_aware_sends_a_dead_engines_rollouts_to_the_others_first() -> None:
    scheduler = KVAwareScheduler([2_000, 2_000], 1_000, range(6))
    assert scheduler.admit() == [(0, 0), (1, 1), (2, 0), (3, 1)]
    scheduler.finish(2)
    assert scheduler.drop_engine(0) == [0]
    scheduler.finish(1)
    # engine 1 alone now: the moved rollout before the ones that never started
    assert scheduler.admit() == [(0, 1)]
    scheduler.finish(3)
    assert scheduler.admit() == [(4, 1)]
    assert scheduler.drop_engine(0) == []


def test_static_deals_a_dead_engines_rollouts_over_the_rest() -> None:
    scheduler = StaticScheduler(3, range(6))
    admitted = scheduler.admit()
    scheduler.finish(0)
    assert scheduler.drop_engine(0) == [3]
    assert scheduler.admit() == [(3, 1)]
    assert len(admitted) == 6 and scheduler.drop_engine(1) == [1, 3, 4]
    assert scheduler.admit() == [(1, 2), (3, 2), (4, 2)]
    assert scheduler.drop_engine(1) == []  # dropped once: what a second report of it finds
