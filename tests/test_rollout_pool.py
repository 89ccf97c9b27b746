"""Rollouts over a run's two vLLM engine actors (Ray), under each scheduler policy.

The engines, the sandbox replica and the trainer rank are started by the run's own lifecycle
object (tasks/runtime: a local Ray on this machine), as a flow starts them. The model is untrained,
so every turn runs to the token budget: long, same-length rollouts on engines whose KV cache holds
only a few of them. The static split overflows the cache (vLLM preempts and recomputes); the
KV-aware scheduler admits only what fits and never does; kv_live admits on what the rollouts hold
as they grow. Once the run's services are stopped, no
process they ran is left. About two minutes on two cores.
"""

import logging
import threading
import time
from dataclasses import replace
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from tasks.cluster.engines import engine_cores
from tasks.config import RunConfig, default_config_path, load_config
from tasks.data.problems import generate_problems
from tasks.records import RolloutSpec, RunContext
from tasks.rollout.agent import run_rollouts
from tasks.rollout.engine import RotaryReloadNotice, available_cores
from tasks.runtime.steps import RollingAhead
from tasks.store import inflight
from tests.processes import alive, wait_gone, wait_until

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
ENGINES = {"engines.kv_cache_gib": 0.00075, "engines.max_model_len": 512, "engines.block_size": 32}


def run_config(model_dir: Path, engines: int, **overrides) -> RunConfig:
    """The tiny run's config on this test's model, with `engines` engine actors. Their logical
    CPUs are a quarter each, so that trainer, engines and sandbox still fit two cores."""
    return load_config(
        default_config_path(),
        {
            "model.path": str(model_dir),
            **ENGINES,
            "engines.count": engines,
            "engines.cpus": 0.25,
            "cluster.startup_timeout_s": 180,  # a placement that cannot happen fails the test, not hangs it
            "sandbox.workers": 2,
            # Budgets within max_model_len (the config refuses others); this file's own are in SPEC.
            "rl.stages": [
                {"name": "stage1", "steps": 1, "max_response_tokens": 120, "max_turns": 2, "problems_per_step": 4}
            ],
            "eval.max_response_tokens": 120,
            **overrides,
        },
    )


def started_pids(where: list[dict]) -> list[int]:
    """Every process the runtime reported starting: its actors and the sandboxes' servers."""
    return [pid for row in where for pid in (row["pid"], row.get("server_pid")) if pid]


def assert_gone(pids: list[int]) -> None:
    assert not wait_gone(pids), "still running after the runtime stopped"


def test_engines_get_their_own_blocks_of_cores() -> None:
    cores = [0, 1, 2, 3, 4, 5]
    assert [engine_cores(i, 1, cores) for i in range(3)] == [[0], [1], [2]]
    assert [engine_cores(i, 2, cores) for i in range(3)] == [[0, 1], [2, 3], [4, 5]]
    # More engines x threads than cores: they wrap around and share.
    assert [engine_cores(i, 1, [4, 7]) for i in range(3)] == [[4], [7], [4]]
    assert engine_cores(0, 8, [0, 1]) == [0, 1]


def test_only_the_rotary_embeddings_reload_notice_is_dropped() -> None:
    def record(*args) -> logging.LogRecord:
        return logging.LogRecord(RotaryReloadNotice.LOGGER, logging.WARNING, "layerwise.py", 266, "%s: %s", args, None)

    notice = RotaryReloadNotice()
    assert not notice.filter(record("RotaryEmbedding", "Failed to load weights"))
    assert notice.filter(record("QKVParallelLinear", "Failed to load weights"))


@pytest.mark.slow
def test_an_engine_actor_runs_engine_threads(model_dir, tmp_path) -> None:
    from tasks.runtime import Runtime

    cfg = run_config(model_dir, 1, **{"engines.threads": 2})
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    with Runtime(cfg, model_dir, tmp_path / "run") as runtime:
        where = runtime.where
        # A few tokens first: the model runs on the actor's stepping thread, which must use the
        # threads too (before any other call reaches that thread), polled with a deadline: an
        # engine whose stepping thread died answers nothing, ever.
        runtime.engines.add_request(0, "r", tokenizer("1 + 1")["input_ids"], 4, 1.0, 1.0, [])
        finished, deadline = [], time.monotonic() + 30
        while not finished and time.monotonic() < deadline:
            finished = runtime.engines.poll(timeout=1.0)
        assert [(engine, turn.request_id) for engine, turn in finished] == [(0, "r")], "the engine generated nothing"
        (stats,) = runtime.engines.stats()
    assert stats["threads"] == 2, stats
    assert_gone(started_pids(where))


@pytest.fixture(scope="module")
def runtime(model_dir, tmp_path_factory):
    from tasks.runtime import Runtime

    cfg = run_config(model_dir, 2)
    with Runtime(cfg, model_dir, tmp_path_factory.mktemp("run")) as runtime:
        pids = started_pids(runtime.where)
        yield runtime
    assert_gone(pids)  # also where the test below was not selected


@pytest.mark.parametrize("policy", ["static", "kv_aware", "kv_observed", "kv_live"])
@pytest.mark.slow
def test_rollouts_complete_on_two_engine_actors(model_dir, runtime, policy) -> None:
    pool, tools = runtime.engines, runtime.tools
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    problems = [(p.problem_id, p.question) for p in generate_problems(4, [1], seed=3)]
    # kv_observed and kv_live: as if the previous batch's rollouts had held 200 tokens each.
    observed = policy in ("kv_observed", "kv_live")
    reserve, previous = ("observed", [200] * 8) if observed else ("max_length", [])
    pool.cfg = pool.cfg.model_copy(
        update={"scheduler": policy.replace("kv_observed", "kv_aware"), "kv_reserve": reserve}
    )
    pool.last_rollout_sizes = previous
    before = pool.stats()
    trajectories, times = run_rollouts(pool, tools, tokenizer, problems, 4, SPEC)
    steps = [a["steps"] - b["steps"] for a, b in zip(pool.stats(), before)]
    assert all(n > 0 for n in steps), steps  # each engine stepped, and counted its steps
    assert len(trajectories) == 16
    for traj in trajectories:
        assert traj.stop_reason, traj
        assert len(traj.response_ids) == len(traj.loss_mask) <= SPEC.max_response_tokens
    assert 0.0 <= times.engine_idle_fraction < 1.0, times
    longest = max(len(t.prompt_ids) for t in trajectories) + SPEC.max_response_tokens
    slots = [kv // longest for kv in pool.kv_tokens]
    assert min(slots) >= 1 and sum(slots) < 16, (pool.kv_tokens, longest)  # the engines cannot hold all at once
    assert all(t.stop_reason != "budget" or len(t.response_ids) > 0 for t in trajectories)
    if observed:
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
def test_each_engine_actor_runs_on_its_own_cores(runtime) -> None:
    engines = [row for row in runtime.where if row["role"] == "engine"]
    assert len({row["pid"] for row in engines}) == 2  # two processes
    for index, stats in enumerate(runtime.engines.stats()):
        assert stats["threads"] == runtime.cfg.engines.threads == 1
        assert stats["cores"] == engine_cores(index, 1, available_cores()), (index, stats)


@pytest.mark.slow
def test_evaluation_samples_differ_at_temperature_0_6(model_dir, runtime) -> None:
    """avg@k needs k real samples: the release evaluated greedily, which makes avg@16 one sample."""

    cfg = load_config(default_config_path())
    spec = cfg.rollout.spec(cfg.eval.model_copy(update={"max_response_tokens": 48}))
    assert spec.temperature == 0.6
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    problems = [(p.problem_id, p.question) for p in generate_problems(3, [1], seed=5)]
    trajectories, _ = run_rollouts(runtime.engines, runtime.tools, tokenizer, problems, 4, spec)
    for problem_id, _ in problems:
        responses = [tuple(t.response_ids) for t in trajectories if t.problem_id == problem_id]
        assert len(responses) == 4 and len(set(responses)) == 4, problem_id


@pytest.mark.slow
def test_a_batch_keeps_what_finished_before_and_ends_with_the_rollouts_in_flight(model_dir, runtime) -> None:
    """What rl.async and a resume ask of the loop: rollouts finished before are not drawn again,
    each new one is handed over once as it ends, a stopped batch starts no group more and ends the
    ones started whole, and an abandoned one starts nothing at all."""
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    problems = [(p.problem_id, p.question) for p in generate_problems(3, [1], seed=7)]
    first, _ = run_rollouts(runtime.engines, runtime.tools, tokenizer, problems, 4, SPEC, version=3)
    assert [t.policy_version for t in first] == [3] * 12
    before = {1: first[1], 6: first[6]}
    handed: list[int] = []

    def draw(**kw):
        handed.clear()
        return run_rollouts(
            runtime.engines, runtime.tools, tokenizer, problems, 4, SPEC,
            on_finish=lambda index, trajectory: handed.append(index), **kw,
        )[0]  # fmt: skip

    # Kept under another prompt (template, tool list or tokenizer changed since): drawn again.
    other_prompt = replace(first[2], prompt_ids=[0] + first[2].prompt_ids)
    again = draw(version=4, finished={**before, 2: other_prompt})
    assert again[1] is first[1] and again[6] is first[6] and again[2].prompt_ids == first[2].prompt_ids
    assert sorted(handed) == [i for i in range(12) if i not in before]
    assert [t.policy_version for i, t in enumerate(again) if i not in before] == [4] * 10

    # Admitted as the paper's scheduler admits, at full length: the tiny config's kv_live at 8x
    # the cache would start all 12 at once.
    runtime.engines.cfg = runtime.engines.cfg.model_copy(update={"scheduler": "kv_aware", "kv_reserve": "max_length"})
    stopped = draw(stop=lambda: bool(handed))
    # The KV cache holds fewer than 12 rollouts (see the test above): the groups not started when
    # the first rollout ends never start, and the started ones end whole (a problem's 4 rollouts).
    assert 0 < len(stopped) < 12 and len(handed) == len(stopped)
    assert all(sum(s.problem_id == t.problem_id for s in stopped) == 4 for t in stopped)
    assert all(t.stop_reason for t in stopped)

    # Abandoned (its step failed) once a rollout ends: the rollouts in flight end there too, and
    # no request outlives the batch: the engines take a weight push at once (refused while they
    # generate), and the next batch, whose request ids are the same, gets only its own turns.
    abandoned = draw(abandon=lambda: bool(handed))
    assert len(abandoned) == len(handed) <= len(stopped)
    runtime.engines.load_from_dir(model_dir, 60)
    after = draw(version=5)
    assert len(after) == 12 and all(t.stop_reason and t.policy_version == 5 for t in after)
    assert all(len(t.response_ids) == len(t.loss_mask) == len(t.behaviour_logprobs) for t in after)


@pytest.mark.parametrize("point", ["at_once", "turns_sent", "rollout_kept"])
@pytest.mark.slow
def test_a_step_that_fails_stops_its_drawing_ahead(model_dir, runtime, tmp_path, point) -> None:
    """rl.async: the step's work fails while the engines draw the next step's rollouts: at once,
    once turns are sent, or once a rollout drawn ahead is kept (this untrained model seldom calls
    the tool: a failure as tool calls go out is test_roc_status.py's). The error leaves the step
    only once the drawing has stopped, having sent no turn and no tool call since the failure: no
    thread is left, the engines are idle at once (a weight push is taken), and the next step's
    in-flight folder keeps only rollouts that had finished. The retry draws the rest of that step
    and keeps those as they were: nothing lost, nothing drawn twice."""
    cfg = run_config(model_dir, 2, **{"rl.async.mode": "one_step", "rl.loss.is_cap": 2.0, "rl.group_size": 2})
    stage = cfg.rl.stages[0].model_copy(update={"steps": 2})
    ctx = RunContext("ahead", tmp_path, "", tmp_path)
    folder = inflight.step_folder(tmp_path, stage.name, 1)
    problems = generate_problems(4, [1], seed=11)
    step_size = stage.problems_per_step * cfg.rl.rollouts_per_problem
    sent = runtime.engines.requests
    reached = {
        "at_once": lambda: True,
        "turns_sent": lambda: runtime.engines.requests > sent,
        "rollout_kept": lambda: any(folder.glob("*.json")),
    }[point]
    ahead = RollingAhead(runtime, ctx, cfg, stage, 0, problems)
    with pytest.raises(RuntimeError, match="the update failed"), ahead:
        wait_until(reached, point, 300)
        raise RuntimeError("the update failed")
    assert ahead.started_after_failure == {"turns": 0, "tool calls": 0}
    assert not [t for t in threading.enumerate() if t.name.startswith("roll-ahead-")]
    runtime.engines.load_from_dir(model_dir, 60)
    kept = inflight.finished(folder)
    assert len(kept) < step_size and all(t.stop_reason and t.policy_version == 0 for t in kept.values())

    # The retry: the step again from the same checkpoint, its drawing ahead not interrupted.
    with RollingAhead(runtime, ctx, cfg, stage, 0, problems) as again:
        drawn = again.finish()["rollouts_ahead"]
    after = inflight.finished(folder)
    assert sorted(after) == list(range(step_size)) and drawn == step_size - len(kept)
    assert all(after[i].response_ids == t.response_ids for i, t in kept.items())


@pytest.mark.slow
def test_weights_are_refused_while_an_engine_generates(model_dir, runtime) -> None:
    """No rollout is drawn by two policy versions: a push comes between rollouts only, and the
    engines stamp every turn with the version of the weights they hold."""
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    version = runtime.engines.weights_version
    for k in range(4):
        runtime.engines.add_request(0, f"busy-{k}", tokenizer("1 + 1")["input_ids"], 480, 1.0, 1.0, [])
    runtime.engines.poll(timeout=0)  # sends them
    time.sleep(0.2)
    with pytest.raises(Exception, match="new weights pushed while requests generate"):
        runtime.engines.load_from_dir(model_dir, 60)
    finished, deadline = [], time.monotonic() + 120
    while len(finished) < 4 and time.monotonic() < deadline:
        finished += runtime.engines.poll(timeout=1.0)
    assert sorted(turn.request_id for _, turn in finished) == [f"busy-{k}" for k in range(4)]
    assert runtime.engines.weights_version == version  # (the idle engine took the refused load)
    assert {turn.weights_version for _, turn in finished} == {version}
    runtime.engines.load_from_dir(model_dir, 60)  # idle again: taken
    assert runtime.engines.weights_version == version + 1

    # A rollout waiting on a tool call holds no request in any engine: the group refuses a load
    # while any batch is under way (here, once its first rollout has ended).
    def load_meanwhile(index, trajectory) -> None:
        runtime.engines.load_from_dir(model_dir, 60)

    problems = [(p.problem_id, p.question) for p in generate_problems(2, [1], seed=9)]
    with pytest.raises(RuntimeError, match=r"while 1 rollout batch\(es\) are under way"):
        run_rollouts(runtime.engines, runtime.tools, tokenizer, problems, 2, SPEC, on_finish=load_meanwhile)
    assert runtime.engines.open_batches == 0 and runtime.engines.weights_version == version + 1


@pytest.mark.slow
def test_no_process_of_the_runtime_outlives_it(runtime) -> None:
    """Last in the module: stops the module's runtime (its own exit then has nothing left to do)."""
    pids = started_pids(runtime.where)
    roles = sorted(row["role"] for row in runtime.where)
    assert roles == ["engine", "engine", "sandbox", "trainer"] and len(pids) == 5, runtime.where
    assert all(alive(pid) for pid in pids)
    runtime.__exit__(None, None, None)
    assert_gone(pids)
