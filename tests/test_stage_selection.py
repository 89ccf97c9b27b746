"""Choosing the RL stages of a run to (re)run, and the saved policies a later evaluation can use."""

from pathlib import Path

import pytest

from tasks.config import load_config
from tasks.records import RunContext
from tasks.store.run_folder import saved_policy

STAGE = {"steps": 1, "max_response_tokens": 32, "max_turns": 1, "problems_per_step": 1}


def _rl():
    return load_config("configs/tiny.yaml", {"rl.stages": [{"name": n, **STAGE} for n in ("a", "b", "c")]}).rl


def test_every_stage_by_default_and_the_listed_ones_in_config_order() -> None:
    assert [s.name for s in _rl().stages_to_run(None, set())] == ["a", "b", "c"]
    assert [s.name for s in _rl().stages_to_run(["b", "a"], set())] == ["a", "b"]


def test_a_stage_needs_the_stages_before_it_finished() -> None:
    with pytest.raises(ValueError, match=r"has not finished stages \['a'\].*stages=\['a', 'b'\]"):
        _rl().stages_to_run(["b"], set())
    assert [s.name for s in _rl().stages_to_run(["b", "c"], {"a"})] == ["b", "c"]
    with pytest.raises(ValueError, match=r"stages \['z'\] are not in the config's rl.stages \['a', 'b', 'c'\]"):
        _rl().stages_to_run(["z"], set())


def test_saved_policy_names_the_ones_there_are(tmp_path: Path) -> None:
    ctx = RunContext("r", tmp_path, "m", tmp_path)
    for name in ("base", "sft"):
        (tmp_path / "models" / name).mkdir(parents=True)
        (tmp_path / "models" / name / "config.json").write_text("{}")
    assert saved_policy(ctx, "sft") == tmp_path / "models" / "sft"
    with pytest.raises(ValueError, match=r"no saved policy 'stage1' \(saved: \['base', 'sft'\]\)"):
        saved_policy(ctx, "stage1")
