"""Config loading: the shipped configs validate; bad input names what and where.

Run: .venv/bin/python -m pytest tests/test_config.py -q
"""

from pathlib import Path

import pytest

from tasks.config import ConfigError, load_config

CONFIGS = Path(__file__).resolve().parent.parent / "configs"


@pytest.mark.parametrize("name", ["tiny.yaml", "qwen3-14b-paper.yaml", "qwen3-4b-8gpu.yaml"])
def test_shipped_configs_validate(name):
    cfg = load_config(CONFIGS / name)
    assert cfg.rl.stages


def test_paper_config_has_the_papers_numbers():
    cfg = load_config(CONFIGS / "qwen3-14b-paper.yaml")
    assert cfg.rl.group_size == 16 and cfg.rl.rollouts_per_problem == 32
    assert [s.steps for s in cfg.rl.stages] == [300, 85, 125]
    assert [s.max_turns for s in cfg.rl.stages] == [10, 10, 15]
    assert cfg.rl.stages[2].hard_only and cfg.rl.stages[2].reset_optimizer
    assert (cfg.rl.optim.lr, cfg.rl.optim.warmup_steps) == (1e-6, 20)
    assert (cfg.rl.loss.eps_low, cfg.rl.loss.eps_high, cfg.rl.loss.dual_clip) == (0.2, 0.28, 3.0)
    assert (cfg.eval.k, cfg.eval.temperature, cfg.eval.max_turns) == (16, 0.6, 30)


def test_roc_off_draws_only_g():
    cfg = load_config(CONFIGS / "tiny.yaml", {"rl.roc.mode": "off"})
    assert cfg.rl.rollouts_per_problem == cfg.rl.group_size


def test_unknown_key_is_named(tmp_path):
    text = (CONFIGS / "tiny.yaml").read_text().replace("group_size:", "group_sise:")
    (tmp_path / "bad.yaml").write_text(text)
    with pytest.raises(ConfigError, match="group_sise"):
        load_config(tmp_path / "bad.yaml")


def test_bad_value_is_named():
    with pytest.raises(ConfigError, match="mode"):
        load_config(CONFIGS / "tiny.yaml", {"rl.roc.mode": "sometimes"})


def test_response_budget_must_fit_the_engine():
    with pytest.raises(ConfigError, match="max_model_len"):
        load_config(CONFIGS / "tiny.yaml", {"engine.max_model_len": 256})


def test_unreadable_yaml_is_named(tmp_path):
    (tmp_path / "broken.yaml").write_text("rl: [unclosed")
    with pytest.raises(ConfigError, match=r"broken\.yaml, line 1: not YAML: "):
        load_config(tmp_path / "broken.yaml")


def message(**overrides) -> str:
    with pytest.raises(ConfigError) as exc:
        load_config(CONFIGS / "tiny.yaml", overrides)
    return str(exc.value)


def test_a_bad_field_is_one_line_naming_the_file_the_field_and_the_value():
    tiny = CONFIGS / "tiny.yaml"
    bad = "Input should be a valid integer, unable to parse string as an integer"
    # A number in a dotted key indexes a list: the first RL stage.
    assert message(**{"rl.stages.0.steps": "abc"}) == f"{tiny}: rl.stages.0.steps: {bad} (got 'abc')"
    both = message(**{"rl.stages.0.steps": "abc", "rl.group_size": "x"})
    assert both == f"{tiny}: rl.group_size: {bad} (got 'x') (and 1 more)"
    # A check across fields has no field path; a missing field has no value to quote.
    assert message(**{"engine.max_model_len": 256}).startswith(f"{tiny}: engine.max_model_len (256) must exceed")
    assert message(**{"rl.stages": [{"steps": 1}]}) == f"{tiny}: rl.stages.0.max_turns: Field required (and 3 more)"
    assert message(**{"rl.stages.7.steps": 1}) == f"{tiny}: rl.stages.7.steps: no such field to override"
