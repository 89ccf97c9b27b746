"""Choosing the RL stages of a run to (re)run, and the saved policies a later evaluation can use."""

from pathlib import Path

import pytest

from tasks.config import load_config
from tasks.resume import saved_policy, stages_to_run
from tasks.runtime import RunContext

STAGE = {"steps": 1, "max_response_tokens": 32, "max_turns": 1, "problems_per_step": 1}


def _cfg():
    return load_config("configs/tiny.yaml", {"rl.stages": [{"name": n, **STAGE} for n in ("a", "b", "c")]})


def test_every_stage_by_default_and_the_listed_ones_in_config_order(tmp_path: Path) -> None:
    ctx = RunContext("r", tmp_path, "m", tmp_path)
    assert [s.name for s in stages_to_run.fn(_cfg(), ctx, None)] == ["a", "b", "c"]
    assert [s.name for s in stages_to_run.fn(_cfg(), ctx, ["b", "a"])] == ["a", "b"]


def test_a_stage_needs_the_stages_before_it_finished(tmp_path: Path) -> None:
    ctx = RunContext("r", tmp_path, "m", tmp_path)
    with pytest.raises(ValueError, match=r"has not finished stages \['a'\].*stages=\['a', 'b'\]"):
        stages_to_run.fn(_cfg(), ctx, ["b"])
    (tmp_path / "state").mkdir()
    (tmp_path / "state" / "rl-a.json").write_text('{"result": 1}')
    assert [s.name for s in stages_to_run.fn(_cfg(), ctx, ["b", "c"])] == ["b", "c"]
    with pytest.raises(ValueError, match=r"stages \['z'\] are not in the config's rl.stages \['a', 'b', 'c'\]"):
        stages_to_run.fn(_cfg(), ctx, ["z"])


def test_saved_policy_names_the_ones_there_are(tmp_path: Path) -> None:
    ctx = RunContext("r", tmp_path, "m", tmp_path)
    for name in ("base", "sft"):
        (tmp_path / "models" / name).mkdir(parents=True)
        (tmp_path / "models" / name / "config.json").write_text("{}")
    assert saved_policy.fn(ctx, "sft") == tmp_path / "models" / "sft"
    with pytest.raises(ValueError, match=r"no saved policy 'stage1' \(saved: \['base', 'sft'\]\)"):
        saved_policy.fn(ctx, "stage1")
