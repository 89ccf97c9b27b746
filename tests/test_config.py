"""Config loading: the shipped configs validate; bad input names what and where; an old key names
its new place; every number has its bounds.

Run: .venv/bin/python -m pytest tests/test_config.py -q
"""

import types
import typing
from pathlib import Path

import pytest
from pydantic import BaseModel

from tasks.config import MOVED, ConfigError, RunConfig, load_config

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
        load_config(CONFIGS / "tiny.yaml", {"engines.max_model_len": 256})


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
    assert message(**{"engines.max_model_len": 256}).startswith(f"{tiny}: engines.max_model_len (256) must exceed")
    assert message(**{"rl.stages": [{"steps": 1}]}) == f"{tiny}: rl.stages.0.max_turns: Field required (and 3 more)"
    assert message(**{"rl.stages.7.steps": 1}) == f"{tiny}: rl.stages.7.steps: no such field to override"


@pytest.mark.parametrize(
    "old, value, line",
    [
        ("engine.kv_cache_gib", 0.5, "engine.kv_cache_gib has moved to engines.kv_cache_gib"),
        ("cluster.engines.count", 2, "cluster.engines.count has moved to engines.count"),
        ("cluster.trainer.ranks", 2, "cluster.trainer.ranks has moved to trainer.ranks"),
        ("cluster.sandbox.replicas", 2, "cluster.sandbox.replicas has moved to sandbox.replicas"),
        ("trainer_threads", 2, "trainer_threads has moved to trainer.threads"),
        ("rl.optim.zero_stage", 2, "rl.optim.zero_stage has moved to trainer.zero_stage"),
        ("sandbox.timeout_s", 2.0, "sandbox.timeout_s has moved to sandbox.program_timeout_s"),
        ("cluster.ready_timeout_s", 60, "cluster.ready_timeout_s has moved to cluster.startup_timeout_s"),
        ("model.parameters_b", 14.8, "model.parameters_b has moved to model.shape (the model's config.json fields"),
    ],
)
def test_an_old_key_is_refused_with_one_line_naming_its_new_place(old, value, line):
    assert message(**{old: value}).startswith(f"{CONFIGS / 'tiny.yaml'}: {line}")


def test_an_old_key_in_a_file_is_refused_too(tmp_path):
    text = (CONFIGS / "tiny.yaml").read_text().replace("\nengines:\n", "\nengine:\n")
    (tmp_path / "old.yaml").write_text(text)
    with pytest.raises(ConfigError, match=r"old\.yaml: engine\.count has moved to engines\.count$"):
        load_config(tmp_path / "old.yaml")


def test_every_moved_key_names_a_place_that_exists():
    tree = load_config(CONFIGS / "tiny.yaml").model_dump()
    for new in MOVED.values():
        node = tree
        for key in new.split(" ")[0].split("."):
            assert key in node, new
            node = node[key]


def _numeric(annotation) -> bool:
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        return any(_numeric(a) for a in typing.get_args(annotation) if a is not type(None))
    return annotation in (int, float)


def _models(model: type[BaseModel], seen: set) -> list[type[BaseModel]]:
    found = [model]
    seen.add(model)
    for info in model.model_fields.values():
        for inner in [info.annotation, *typing.get_args(info.annotation)]:
            for candidate in [inner, *typing.get_args(inner)]:
                if isinstance(candidate, type) and issubclass(candidate, BaseModel) and candidate not in seen:
                    found += _models(candidate, seen)
    return found


def test_every_numeric_field_has_its_bounds():
    unbounded = [
        f"{model.__name__}.{name}"
        for model in _models(RunConfig, set())
        for name, info in model.model_fields.items()
        if _numeric(info.annotation) and not any(hasattr(m, a) for m in info.metadata for a in ("ge", "gt", "le", "lt"))
    ]
    assert unbounded == []


@pytest.mark.parametrize(
    "field, value",
    [("rl.group_size", -3), ("rl.stages.0.steps", 0), ("engines.count", 0), ("eval.k", 0), ("rl.optim.lr", -1.0)],
)
def test_a_number_out_of_bounds_is_refused_naming_the_field(field, value):
    assert message(**{field: value}).startswith(f"{CONFIGS / 'tiny.yaml'}: {field}: Input should be greater than")
