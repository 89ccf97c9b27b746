"""A run's local Ray (two engines, two sandbox replicas, a trainer rank), started once by the run's
lifecycle object. First, whole: a push from the rank reaches both engines over a process group
(gloo), and after the next update through Ray's object store. Then actors SIGKILLed while they
work:

- an engine in the middle of a rollout batch: the batch completes on the other engine with every
  rollout once, the rollouts it held counted as re-queued; Ray restarts the actor, and the next
  weight sync brings it back into the pool and the sync group with the trainer's current weights;
- an engine that dies unnoticed just before a weight push: the push goes on without it (every
  member of a sync group fails when one dies, so the push is made again without the dead one);
- a sandbox replica with calls in flight: each call is answered once, from the other replica,
  none as an outage; Ray restarts the replica and the client sends to its new address.

Last, a stage boundary: a reset gives the trainer rank a fresh optimizer on the current weights.

About two and a half minutes on two cores."""

import json
import os
import random
import signal
import threading
import time
import urllib.request

import pytest
import torch
from transformers import AutoTokenizer

from tasks.data.problems import generate_problems
from tasks.records import Sample, ToolStatus
from tasks.rollout.agent import run_rollouts
from tasks.rollout.metrics import max_logprob_gap
from tests.processes import wait_gone, wait_until
from tests.test_rollout_pool import SPEC, run_config, started_pids

pytestmark = pytest.mark.slow

SEED = 7


def kill_after(ready, victims: list[int], rng: random.Random, killed: list) -> threading.Thread:
    """SIGKILL the `victims` a seeded moment (0-0.5 s) after `ready()` returns."""

    def kill() -> None:
        ready()
        time.sleep(rng.uniform(0, 0.5))
        for victim in victims:
            os.kill(victim, signal.SIGKILL)
        killed.extend(victims)

    thread = threading.Thread(target=kill, daemon=True)
    thread.start()
    return thread


def pid_of(where: list[dict], role: str, index: int, key: str = "pid") -> int:
    return next(row[key] for row in where if row["role"] == role and row["index"] == index)


@pytest.fixture(scope="module")
def runtime(model_dir, tmp_path_factory):
    from tasks.runtime import Runtime

    cfg = run_config(
        model_dir,
        2,
        **{
            "engines.kv_cache_gib": 0.01,
            # lr x 1/3, 2/3, then 1: each step of a warm-up shows in the step's lr.
            "rl.optim": {"lr": 1e-2, "warmup_steps": 2, "micro_batch_size": 4},
            "trainer.zero_stage": 1,
            "cluster.weight_sync": "gloo",
            "cluster.weight_sync_timeout_s": 120,
            # A push whose group waits on an engine that died unnoticed gives up after this (60 s
            # by default); a bucket here crosses in well under a second.
            "cluster.weight_sync_bucket_timeout_s": 15,
            "sandbox.replicas": 2,
            "sandbox.cpus": 0.25,
            "sandbox.workers": 1,
        },
    )
    with Runtime(cfg, model_dir, tmp_path_factory.mktemp("run")) as runtime:
        runtime.started = started_pids(runtime.where)  # and the pids of restarted actors, as tests see them
        yield runtime
    assert not wait_gone(runtime.started)


def test_every_engine_actor_follows_the_trainer_rank_over_either_backend(model_dir, runtime) -> None:
    from tasks.cluster.sync import WeightSync
    from tests.test_weight_sync import TOLERANCE

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    texts = [p.question + "\n" + p.solution_code for p in generate_problems(4, [1, 2], seed=2)]
    samples = [Sample(ids, [1] * len(ids), advantage=1.0) for ids in tokenizer(texts)["input_ids"]]
    sequences = [s.token_ids for s in samples]
    assert len(runtime.engines.kv_tokens) == 2 and min(runtime.engines.kv_tokens) > 0
    trainer = runtime.policy_trainer(total_steps=10, reset_optimizer=False)

    def gaps() -> list[float]:
        """Each engine's worst log-prob gap to the trainer rank."""
        trainer_view = trainer.token_logprobs(samples)
        return [max_logprob_gap(view, trainer_view) for view in runtime.engines.prompt_logprobs(sequences)]

    fresh = gaps()
    assert max(fresh) < TOLERANCE, fresh  # the same weights on both sides before any update
    object_store = runtime.cfg.cluster.model_copy(update={"weight_sync": "object_store"})
    for sync in (runtime.weight_sync, WeightSync(runtime.trainer, runtime.engines, object_store)):
        trainer.sft_step(samples)
        stale = gaps()
        assert min(stale) > 10 * TOLERANCE, (sync.backend, stale)
        sent = sync.push()
        assert sent["bytes"] > 0, (sync.backend, sent)
        synced = gaps()
        assert max(synced) < TOLERANCE, (sync.backend, synced)
    assert [runtime.weight_sync.backend, sync.backend] == ["gloo", "object_store"]


def test_a_dead_engine_costs_a_requeue_and_comes_back_with_the_weights(model_dir, runtime) -> None:
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    problems = [(p.problem_id, p.question) for p in generate_problems(16, [1], seed=3)]
    pool = runtime.engines
    victim = pid_of(runtime.where, "engine", 1)
    killed: list[int] = []
    calls = pool.calls
    generating = lambda: wait_until(lambda: pool.calls > calls + 8, "generation", 120)  # noqa: E731
    killer = kill_after(generating, [victim], random.Random(SEED), killed)
    trajectories, times = run_rollouts(pool, runtime.tools, tokenizer, problems, 8, SPEC)
    killer.join(timeout=5)
    assert killed == [victim], "the engine was not killed while the batch ran"
    assert sorted((t.problem_id, t.sample) for t in trajectories) == sorted(
        (pid, s) for pid, _ in problems for s in range(8)
    )
    assert all(t.stop_reason for t in trajectories)
    assert times.requeued_rollouts > 0 and times.engine_deaths == 1 and pool.serving == [True, False]

    # A step moves the trainer's weights; the restarted engine must get them, not its first ones.
    samples = [
        Sample(t.prompt_ids + t.response_ids, [0] * len(t.prompt_ids) + t.loss_mask, 1.0) for t in trajectories[:4]
    ]
    trainer = runtime.policy_trainer(total_steps=10, reset_optimizer=False)
    trainer.rl_step(samples, runtime.cfg.rl.loss)
    deadline = time.monotonic() + 180
    while pool.restarts == 0:
        assert time.monotonic() < deadline, "the dead engine never came back"
        runtime.sync_weights([])
        time.sleep(1)
    assert pool.serving == [True, True]
    trainer_view = trainer.token_logprobs(samples)
    gaps = [max_logprob_gap(view, trainer_view) for view in pool.prompt_logprobs([s.token_ids for s in samples])]
    assert len(gaps) == 2 and max(gaps) < 2e-3, gaps  # fp32 in vLLM vs torch: test_weight_sync's TOLERANCE
    again, times = run_rollouts(pool, runtime.tools, tokenizer, problems[:2], 4, SPEC)
    assert len(again) == 8 and times.requeued_rollouts == 0 and times.engine_deaths == 0
    runtime.started += started_pids(runtime.placement.where(30))


def test_an_engine_dead_as_the_push_begins_is_dropped_from_it_and_comes_back(runtime) -> None:
    """Killed once it has answered everything, so that nothing the group waits on finds the death
    before the push does: the push goes on without the engine, and a later one brings it back."""
    pool = runtime.engines
    assert pool.serving == [True, True]
    time.sleep(1)  # every outstanding take answers (each waits at most half a second)...
    pool.check()  # ...and is collected, so no call to the engine is left in flight
    victim = pid_of(runtime.placement.where(30), "engine", 0)
    deaths, restarts = pool.deaths, pool.restarts
    os.kill(victim, signal.SIGKILL)
    assert not wait_gone([victim])
    runtime.sync_weights([])
    assert pool.serving == [False, True] and pool.deaths == deaths + 1
    assert len(pool.prompt_logprobs([[1, 2, 3]])) == 1
    # Back once Ray has restarted it: before the next update's push (as a step's rollouts begin).
    deadline = time.monotonic() + 180
    while runtime.rejoin_restarted() == 0:
        assert time.monotonic() < deadline, "the dead engine never came back"
        time.sleep(1)
    assert pool.restarts == restarts + 1 and pool.serving == [True, True]
    assert len(pool.prompt_logprobs([[1, 2, 3]])) == 2
    runtime.started += started_pids(runtime.placement.where(30))


def stats(url: str, token: str) -> dict:
    request = urllib.request.Request(url + "/stats", headers={"Authorization": f"Bearer {token}"})
    with urllib.request.urlopen(request, timeout=10) as response:
        return json.load(response)


def answered_once_each(runtime, victims: list[int], n: int = 300) -> None:
    """n calls, the victims SIGKILLed while they run: every call answered, with its own output."""
    program = "import time\ntime.sleep(0.02)\nprint({i})"
    retried = runtime.tools.client.retried
    futures = [runtime.tools.submit(program.format(i=i), "") for i in range(n)]
    killed: list[int] = []
    killer = kill_after(lambda: futures[20].result(), victims, random.Random(SEED), killed)
    results = [f.result(timeout=300) for f in futures]
    killer.join(timeout=5)
    assert killed == victims
    assert [r.status for r in results] == [ToolStatus.OK] * n, {r.status for r in results}
    assert [r.stdout.strip() for r in results] == [str(i) for i in range(n)]  # each its own answer, once
    assert runtime.tools.client.retried > retried


def wait_for_replica(runtime, index: int, gone_url: str | None) -> None:
    """Until replica `index` serves calls again (at a new URL, when `gone_url` is given)."""
    client = runtime.tools.client
    deadline = time.monotonic() + 120
    while client.passed_over(index) or client.urls[index] == gone_url:
        assert time.monotonic() < deadline, "the replica never came back"
        runtime.tools.submit("print(1)", "").result(timeout=60)
        time.sleep(0.5)
    done = stats(client.urls[index], runtime.sandbox_token)["done"]
    for i in range(20):
        assert runtime.tools.submit(f"print({i})", "").result(timeout=120).status is ToolStatus.OK
    assert stats(client.urls[index], runtime.sandbox_token)["done"] > done  # it serves again


def test_a_dead_sandbox_replica_costs_a_retry_never_an_answer(runtime) -> None:
    """The replica's actor and its server both killed, as when their node goes: Ray restarts the
    actor, which starts a server on a new port, and the client finds it."""
    where = runtime.placement.where(30)
    gone_url = runtime.tools.client.urls[0]
    answered_once_each(runtime, [pid_of(where, "sandbox", 0), pid_of(where, "sandbox", 0, "server_pid")])
    wait_for_replica(runtime, 0, gone_url)
    runtime.started += started_pids(runtime.placement.where(30))


def test_a_dead_sandbox_server_is_started_again_by_its_replica(runtime) -> None:
    where = runtime.placement.where(30)
    answered_once_each(runtime, [pid_of(where, "sandbox", 1, "server_pid")])
    wait_for_replica(runtime, 1, None)
    runtime.started += started_pids(runtime.placement.where(30))


def test_stage_boundary_reset_keeps_weights_and_drops_optimizer_state(runtime) -> None:
    """A stage that resets the optimizer starts a fresh one from the current weights (its warm-up
    starts over); the next stage without a reset continues it (its warm-up goes on)."""
    samples = [Sample(list(range(3, 15 + i)), [0] * 4 + [1] * (8 + i), a) for i, a in enumerate([1.0, -1.0])]
    (weights,) = runtime.trainer.parameters()
    reset = runtime.policy_trainer(total_steps=5, reset_optimizer=True)
    (restarted,) = reset.parameters()
    assert restarted.keys() == weights.keys()
    assert all(torch.equal(weights[name], tensor) for name, tensor in restarted.items())
    fresh_lr = reset.rl_step(samples, runtime.cfg.rl.loss)["lr"]
    kept = runtime.policy_trainer(total_steps=5, reset_optimizer=False)  # the next stage, no reset
    continued_lr = kept.rl_step(samples, runtime.cfg.rl.loss)["lr"]
    assert continued_lr > fresh_lr  # the same optimizer, one step further into its warm-up
    again = runtime.policy_trainer(total_steps=5, reset_optimizer=True)
    assert again.rl_step(samples, runtime.cfg.rl.loss)["lr"] == pytest.approx(fresh_lr)  # a fresh warm-up
