"""The rollout scheduler policies (pure) and the paper-scale simulator that drives them."""

import dataclasses
import sys
from pathlib import Path

import pytest

from tasks.records import TurnTrace
from tasks.rollout.scheduler import (
    KVAwareScheduler,
    LiveKVScheduler,
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


def test_kv_live_counts_each_rollout_at_its_reserve_or_its_live_size_whichever_is_more() -> None:
    # One engine of 3,000 KV tokens, a reserve of 1,000: three rollouts while all are small.
    scheduler = LiveKVScheduler([3_000], 1_000, range(10))
    assert scheduler.admit() == [(0, 0), (1, 0), (2, 0)]
    scheduler.resize(0, 400)  # within its reserve: it keeps the reserve for what is to come
    scheduler.resize(1, 1_600)  # past it: it holds what it holds
    scheduler.finish(2)
    assert scheduler.admit() == []  # 1,000 + 1,600 + a new 1,000 > 3,000
    scheduler.finish(1)
    assert scheduler.admit() == [(3, 0), (4, 0)]  # its 1,600 freed, not its reserve


def test_kv_live_overcommit_plans_engines_past_their_cache() -> None:
    assert len(LiveKVScheduler([3_000], 1_000, range(10)).admit()) == 3
    assert len(LiveKVScheduler([3_000], 1_000, range(10), overcommit=2.0).admit()) == 6
    with pytest.raises(ValueError, match="overcommit must be at least 1"):
        LiveKVScheduler([3_000], 1_000, range(10), overcommit=0.5)


def test_kv_live_sends_a_dead_engines_rollouts_to_the_others_first() -> None:
    scheduler = make_scheduler("kv_live", [2_000, 2_000], 1_000, range(6))
    assert scheduler.admit() == [(0, 0), (1, 1), (2, 0), (3, 1)]
    scheduler.resize(1, 1_500)
    assert scheduler.drop_engine(1) == [1, 3]
    scheduler.finish(0)
    assert scheduler.admit() == [(1, 0)]  # the moved rollouts first, on the engine left
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
            overcommit=1.0,
        ),
    )
    tight = scheduler_sim.Hardware(kv_tokens=30_000)
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
    live = scheduler_sim.simulate("kv_live", args, tight, reserve="observed")
    assert (live["preemptions"], live["prefix_evictions"]) == (0, 0)  # never planned past the cache
    assert live["makespan_s"] < kv_aware["makespan_s"]
    for result in (static, kv_aware, observed, live):
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
    assert record[:3] == [100, [5, 3], [[10, 0.5]]]
    assert record[3] == [pytest.approx(0.1)]  # back at 1.0, the tool's 0.5 s, out again at 1.6
    hw = scheduler_sim.Hardware(
        kv_tokens=10_000, step_base_s=0.01, step_per_seq_s=0.0, step_per_context_token_s=0.0,
        prefill_per_token_s=0.001, max_chunk_steps=1,
    )  # fmt: skip
    alone = scheduler_sim.PromptSharing(group_size=1, block_size=1, common_tokens=0)
    for scheduler in ("static", "kv_aware"):
        run = {"scheduler": scheduler, "reserve": 200, "rollouts": [record]}
        assert scheduler_sim.replayed(run, 1, hw, alone)["makespan_s"] == pytest.approx(0.69)
    # The driver's 20 ms at each of its two turns' ends: before the tool call and at the end.
    driven = dataclasses.replace(hw, turn_overhead_s=0.02)
    assert scheduler_sim.replayed(run, 1, driven, alone)["makespan_s"] == pytest.approx(0.73)
    # A malformed call answered without the sandbox waits on nothing.
    traces[0].tool_latency_s = None
    assert scheduler_sim.replay_record(traces)[2] == [[10, 0.0]]
    assert scheduler_sim.replay_record(traces)[3] == [pytest.approx(0.6)]


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


def test_either_pool_fit_recovers_the_costs_its_runs_were_stepped_at() -> None:
    import engine_calibration

    cost = {"step_base_s": 3e-3, "step_per_seq_s": 1e-4, "step_per_context_token_s": 3e-7, "prefill_per_token_s": 4e-5}
    runs = []
    for k in range(6):
        # Two engines; rollouts of a 50 + 10k-token prompt, a turn of 20 + 5k tokens, a tool's 7
        # tokens, then a 9-token turn: the sums below, by hand, for each engine's rollouts.
        # Rollouts 0 and 1 are a group on engine 0: its prompt is prefilled once there.
        rollouts = [[50 + 10 * k, [20 + 5 * k, 9], [[7, 0.01]], [0.001], e] for e in (0, 0, 1)]
        steps = [40 + 13 * k, 25 + 3 * k * k]
        engine_steps = []
        for engine, n in enumerate(steps):
            mine = [r for r in rollouts if r[4] == engine]
            prompt, first = 50 + 10 * k, 20 + 5 * k
            seqs = len(mine) * (first + 9)
            context = len(mine) * (first * prompt + first * (first - 1) / 2 + 9 * (prompt + first + 7) + 36)
            prefilled = prompt + len(mine) * 7
            busy = engine_calibration.predicted(cost, seqs, context, prefilled, steps=n)
            engine_steps.append({"busy_s": busy, "steps": n})
        runs.append({"policy": "static", "preemptions": 0, "engine_steps": engine_steps, "rollouts": rollouts})
    runs.append({**runs[0], "preemptions": 3, "engine_steps": [{"busy_s": 99.0, "steps": 1}] * 2})  # left out
    workload = {"label": "w", "group_size": 2, "block_size": 1, "common_prefix_tokens": 0, "runs": runs}
    rows = engine_calibration.pool_rows({"workloads": [workload]})
    assert len(rows) == 12
    # The per-token terms from the engine alone; the per-step and per-request ones from the pool.
    alone = {**cost, "step_base_s": 1.0, "step_per_seq_s": 1.0}
    fitted = engine_calibration.fit_pool(rows, alone)
    for term, value in cost.items():
        assert fitted[term] == pytest.approx(value, rel=1e-6)
    # Stepped at 1.7x the engine alone's every term: the uniform fit finds the factor.
    slower = {term: value / 1.7 for term, value in cost.items()}
    uniform = engine_calibration.fit_pool_uniform(rows, slower)
    for term, value in cost.items():
        assert uniform[term] == pytest.approx(value, rel=1e-6)


def test_rollouts_share_their_groups_and_the_common_prompt_blocks_on_an_engine() -> None:
    # Two rollouts of one 100-token prompt, 10 tokens each, on one engine of 125 KV tokens: 1 ms a
    # prefilled token, 10 ms a step. Shared, both run at once and the prompt is prefilled once:
    # 0.1 + 10 x 0.01 = 0.2 s. Each with its own prompt, the second waits for the first: 0.4 s.
    hw = scheduler_sim.Hardware(
        kv_tokens=125, step_base_s=0.01, step_per_seq_s=0.0, step_per_context_token_s=0.0,
        prefill_per_token_s=0.001, max_chunk_steps=1,
    )  # fmt: skip
    run = {"scheduler": "static", "reserve": 110, "rollouts": [[100, [10], [], [], 0]] * 2}
    group = scheduler_sim.PromptSharing(group_size=2, block_size=1, common_tokens=0)
    assert scheduler_sim.replayed(run, 1, hw, group)["makespan_s"] == pytest.approx(0.2)
    own = scheduler_sim.PromptSharing(group_size=1, block_size=1, common_tokens=0)
    assert scheduler_sim.replayed(run, 1, hw, own)["makespan_s"] == pytest.approx(0.4)
    # Two groups whose prompts start with the same 96 tokens, in blocks of 32: the second holds 4
    # of its own, so both fit (100 + 10 + 4 + 10 = 124) and it prefills 4: 0.104 + 0.1 s.
    common = scheduler_sim.PromptSharing(group_size=1, block_size=32, common_tokens=99)
    assert scheduler_sim.replayed(run, 1, hw, common)["makespan_s"] == pytest.approx(0.204)
    # Preempted, evicted or ended, every token held comes back: nothing leaks.
    rollouts = [scheduler_sim.Rollout(100, [20], [], context=100, group=0, group_prefix=100) for _ in range(2)]
    sim = scheduler_sim.Simulation(rollouts, 1, hw, "static", 110)
    result = sim.run()
    assert result["preemptions"] > 0  # 100 + 20 + 20 outgrow the 125, one alone does not
    assert (sim.engines[0].used, sim.engines[0].holders, sim.engines[0].holding) == (0, {}, 0)
