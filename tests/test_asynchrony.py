"""The rules of asynchronous RL (tasks/rl/asynchrony.py), the `rl.async` config section, and the
in-flight store that keeps rollouts as they finish (tasks/store/inflight.py).

python -m pytest tests/test_asynchrony.py -q
"""

import json
from dataclasses import replace

import pytest

from tasks.config import AsyncConfig, ConfigError, default_config_path, load_config
from tasks.records import RolloutSpec, ToolCallRecord, ToolStatus, Trajectory, TurnTrace
from tasks.rl.asynchrony import fresh, idle_fraction, staleness, steps_ahead
from tasks.store import inflight

OFF, ONE_STEP = AsyncConfig(), AsyncConfig(mode="one_step")


def bounded(k: int) -> AsyncConfig:
    return AsyncConfig(mode="bounded", max_staleness=k)


def test_off_draws_nothing_ahead_and_one_step_draws_the_next_step() -> None:
    assert steps_ahead(OFF, 0, 20) == ([], [])
    assert steps_ahead(ONE_STEP, 0, 20) == ([1], [])
    assert steps_ahead(ONE_STEP, 18, 20) == ([19], [])


def test_bounded_goes_on_up_to_its_staleness_and_never_past_the_stage() -> None:
    assert steps_ahead(bounded(2), 3, 20) == ([4], [5])
    assert steps_ahead(bounded(4), 3, 20) == ([4], [5, 6, 7])
    assert steps_ahead(bounded(4), 17, 20) == ([18], [19])
    assert steps_ahead(bounded(1), 3, 20) == steps_ahead(ONE_STEP, 3, 20)
    for overlap in (OFF, ONE_STEP, bounded(3)):  # the last step's update has no step after it
        assert steps_ahead(overlap, 19, 20) == ([], [])


def test_staleness_limits_follow_the_mode() -> None:
    assert [OFF.staleness_limit, ONE_STEP.staleness_limit, bounded(3).staleness_limit] == [0, 1, 3]


def trajectory(problem: str, sample: int, version: int) -> Trajectory:
    return Trajectory(problem, sample, [1, 2, 3], policy_version=version)


def test_rollouts_older_than_the_limit_or_newer_than_the_update_are_dropped() -> None:
    finished = {i: trajectory("p", i, v) for i, v in enumerate([5, 4, 3, 2, 6])}
    kept, dropped = fresh(finished, trained_version=5, limit=2, group_size=1, drawing_version=5)
    assert sorted(kept) == [0, 1, 2] and dropped == [3, 4]
    # rl.async off: only its own version
    kept, dropped = fresh(finished, trained_version=5, limit=0, group_size=1, drawing_version=5)
    assert sorted(kept) == [0] and dropped == [1, 2, 3, 4]


def test_groups_are_kept_and_dropped_whole_never_mixing_versions() -> None:
    """Groups of 3 (batch indices 0-2, 3-5, ...), step 5 trained with max_staleness 2, its rest
    drawn now by version 4 (as bounded draws ahead)."""
    versions = {
        0: 4, 1: 4, 2: 4,  # whole, one version, fresh: kept
        3: 4, 4: 3,  # mixed versions (a step stopped part-way, then drawn on): dropped whole
        6: 2, 7: 3, 8: 3,  # one member too stale: the group goes, not just that rollout
        9: 3, 10: 3,  # partial, by version 3 while the rest is drawn by 4: dropped
        12: 4,  # partial, by the version that draws its rest: kept
        15: 3, 16: 3, 17: 3,  # whole by version 3: kept (2 behind, within the limit)
    }  # fmt: skip
    finished = {i: trajectory(f"p{i // 3}", i % 3, v) for i, v in versions.items()}
    kept, dropped = fresh(finished, trained_version=5, limit=2, group_size=3, drawing_version=4)
    assert sorted(kept) == [0, 1, 2, 12, 15, 16, 17]
    assert dropped == [3, 4, 6, 7, 8, 9, 10]
    for group in {i // 3 for i in kept}:
        assert len({kept[i].policy_version for i in kept if i // 3 == group}) == 1


def test_staleness_is_the_mean_and_most_versions_behind() -> None:
    assert staleness([3, 3, 2, 1], 3) == (0.75, 2)
    assert staleness([], 3) == (0.0, 0)


def test_idle_fraction_is_the_share_of_wall_time_not_busy() -> None:
    assert idle_fraction(3.0, 4.0) == 0.25
    assert idle_fraction(3.0, 4.0, workers=2) == 0.625
    assert idle_fraction(5.0, 4.0) == 0.0  # busy counted past the window's edges
    assert idle_fraction(1.0, 0.0) == 0.0


def test_the_async_section_is_read_under_its_yaml_name() -> None:
    cfg = load_config(
        default_config_path(), {"rl.async.mode": "bounded", "rl.async.max_staleness": 3, "rl.loss.is_cap": 2.0}
    )
    assert cfg.rl.overlap == bounded(3)
    assert json.loads(cfg.model_dump_json())["rl"]["async"] == {"mode": "bounded", "max_staleness": 3}
    assert load_config(default_config_path()).rl.overlap == OFF  # the default: on-policy


def test_off_policy_training_without_the_correction_is_refused() -> None:
    with pytest.raises(ConfigError, match=r"rl.async.mode 'one_step' .* set rl.loss.is_cap"):
        load_config(default_config_path(), {"rl.async.mode": "one_step"})
    with pytest.raises(ConfigError, match="rl.async"):
        load_config(default_config_path(), {"rl.async.mode": "sometimes", "rl.loss.is_cap": 2.0})
    # The engine's log-probs would be over the top-p nucleus, the trainer's over the vocabulary.
    with pytest.raises(ConfigError, match="rollout.top_p 0.95 with rl.loss.is_cap"):
        load_config(default_config_path(), {"rl.loss.is_cap": 2.0, "rollout.top_p": 0.95})


def test_a_finished_rollout_comes_back_as_it_was_kept(tmp_path) -> None:
    folder = inflight.step_folder(tmp_path / "run", "stage1", 3)
    done = Trajectory(
        "p7", 2, [1, 2], [5, 6, 7], [1, 0, 1], "text", 2, [ToolCallRecord(1, ToolStatus.TIMEOUT, 0.5, "x")]
    )
    done.stop_reason, done.behaviour_logprobs, done.policy_version = "answer", [-0.5, 0.0, -1.25], 2
    done.turn_traces = [TurnTrace(1, 2, 2, 1, 100.0, 100.5, 0.5, 1), TurnTrace(0, 4, 1, 1, 101.0, 101.2)]
    inflight.keep_finished(folder, 11, done)
    (folder / ".000012.json.abc.tmp").write_text("{")  # a write the kill interrupted: never renamed
    assert inflight.finished(folder) == {11: done}
    assert inflight.finished(inflight.step_folder(tmp_path / "run", "stage1", 4)) == {}  # a step not begun
    # Too stale to train on: deleted once dropped, so the next draw neither reuses nor counts it.
    inflight.keep_finished(folder, 12, trajectory("p", 12, 0))
    _, dropped = fresh(inflight.finished(folder), trained_version=3, limit=1, group_size=1, drawing_version=3)
    inflight.discard(folder, dropped)
    assert dropped == [12] and inflight.finished(folder) == {11: done}


def test_a_damaged_file_is_named_and_the_folder_goes_once_the_step_is_recorded(tmp_path) -> None:
    run = tmp_path / "run"
    folder = inflight.step_folder(run, "stage1", 0)
    inflight.keep_finished(folder, 0, trajectory("p", 0, 0))
    (folder / "000001.json").write_text('{"problem_id": "p"}')
    with pytest.raises(ValueError, match="000001.json: not a finished rollout"):
        inflight.finished(folder)
    inflight.keep_finished(inflight.step_folder(run, "stage1", 1), 0, trajectory("p", 0, 0))
    inflight.forget(folder)
    assert not folder.exists() and (run / "inflight" / "stage1" / "step=1").exists()
    inflight.forget(inflight.step_folder(run, "stage1", 1))
    assert not (run / "inflight").exists()


def test_a_step_overlapped_takes_the_longer_of_rollouts_and_update_plus_the_push() -> None:
    from tasks.rl.asynchrony import step_time

    assert step_time("off", 30.0, 20.0, 2.0) == 52.0
    assert step_time("one_step", 30.0, 20.0, 2.0) == step_time("bounded", 30.0, 20.0, 2.0) == 32.0
    assert step_time("one_step", 10.0, 20.0, 2.0) == 22.0


def test_a_bare_off_in_yaml_means_off(tmp_path) -> None:
    text = (default_config_path()).read_text().replace('async: {mode: "off"}', "async: {mode: off}")
    assert "async: {mode: off}" in text
    (tmp_path / "tiny.yaml").write_text(text)
    assert load_config(tmp_path / "tiny.yaml").rl.overlap == OFF


def test_rollouts_kept_under_other_settings_are_drawn_again(tmp_path) -> None:
    """A resume with another temperature, budget, tool or group size reuses none of the step's
    kept rollouts (the index of one is problem position x samples + sample)."""
    spec = RolloutSpec(4, 512, 1.0, 1.0, "execute_python_code_with_standard_io", 256)
    folder, before = inflight.step_folder(tmp_path, "stage1", 2), inflight.settings_key(spec, 8)
    assert inflight.settle(folder, before) == 0
    for index in (0, 5):
        inflight.keep_finished(folder, index, trajectory("p", index, 1))
    assert inflight.settle(folder, before) == 0 and sorted(inflight.finished(folder)) == [0, 5]
    for changed in (replace(spec, temperature=0.6), replace(spec, max_response_tokens=256)):
        assert inflight.settle(folder, inflight.settings_key(changed, 8)) == 2
        assert inflight.finished(folder) == {}
        inflight.keep_finished(folder, 0, trajectory("p", 0, 1))
        inflight.keep_finished(folder, 5, trajectory("p", 5, 1))
    assert inflight.settle(folder, inflight.settings_key(spec, 16)) == 2
    inflight.keep_finished(folder, 3, trajectory("p", 3, 1))
    (folder / inflight.SETTINGS).unlink()  # kept, but under settings nobody recorded
    assert inflight.settle(folder, before) == 1
