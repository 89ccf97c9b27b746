"""The one typed config of a pipeline run, loaded from configs/*.yaml.

Every difference between the paper and the public release is a field here (see the
`roc`, `count_turns`, `tool_name` and evaluation fields), so either can be reproduced
without touching code.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import ConfigDict, Field, ValidationError, field_validator, model_validator

from tasks.config.cluster import ClusterConfig
from tasks.config.model import ModelConfig, PretrainLayouts, TinyModelConfig
from tasks.config.roles import EnginesConfig, SandboxConfig, TrainerConfig, _Strict
from tasks.config.update import AsyncConfig, LossConfig, OptimConfig, RocConfig
from tasks.records import RolloutSpec


class _Source(_Strict):
    """Where examples come from: the generated set, or a file (`path`)."""

    name: str
    path: str | None = None
    limit: int | None = Field(None, ge=1)  # the first rows only

    @model_validator(mode="after")
    def _path_given(self) -> _Source:
        if self.format != "generated" and not self.path:
            raise ValueError(f"source {self.name!r}: format {self.format!r} needs a path")
        return self


class SourceConfig(_Source):
    """A problem source: the generated set, or a file in a public data set's own layout, read
    through a column mapping (dotted paths reach nested values: `prompt.0.content`)."""

    format: Literal["generated", "parquet", "jsonl", "hf_disk"] = "generated"
    split: str | None = None  # hf_disk: a split directory of a saved DatasetDict
    problem: str = "problem"
    answer: str = "answer"
    id: str | None = None  # a column with stable row ids (default: the row number)


class RolloutBudget(_Strict):
    """What one rollout may spend; shared by the RL stages, the consensus filter and evaluation.
    `temperature` None samples at `rollout.temperature` (filled in when the run config loads)."""

    max_turns: int = Field(ge=1)
    max_response_tokens: int = Field(ge=1)
    temperature: float | None = Field(None, ge=0)


class ConsensusConfig(RolloutBudget):
    n: int = Field(8, ge=1)
    m: int = Field(1, ge=1)
    max_turns: int = Field(10, ge=1)
    max_response_tokens: int = Field(1024, ge=1)

    @model_validator(mode="after")
    def _m_at_most_n(self) -> ConsensusConfig:
        if self.m > self.n:
            raise ValueError(f"consensus.m ({self.m}) cannot exceed consensus.n ({self.n})")
        return self


MalformedRows = Literal["error", "skip"]  # what a data row without its problem or answer does


class DataConfig(_Strict):
    n_train: int = Field(512, ge=1)  # generated problems: train + held-out are generated together
    n_heldout: int = Field(64, ge=1)  # held out of the curated problems, whatever their source
    levels: list[Annotated[int, Field(ge=1, le=9)]] = Field([1, 2, 3], min_length=1)
    kinds: list[str] | None = None  # generated problems' kinds (tasks/data/problems.py); None: all
    seed: int = Field(0, ge=0)
    sources: list[SourceConfig] = [SourceConfig(name="generated")]
    # Evaluation benchmarks (AIME, MATH-500, ...): decontaminated against, and evaluated on.
    benchmarks: list[SourceConfig] = []
    max_answer_digits: int = Field(12, ge=1)
    # Consensus filter (optional): ask the policy n times per training problem (after SFT, the
    # first policy that can answer) and keep problems solved at least m times: drops labels the
    # model consistently contradicts, which are more often wrong labels than hard problems.
    consensus: ConsensusConfig | None = None
    near_duplicate_threshold: float = Field(0.85, gt=0, le=1)  # character 5-gram Jaccard
    decontamination_ngram: int = Field(8, ge=1)
    # A row of any file source (problems, benchmarks, SFT chats) without its problem or answer:
    # error stops the run before it writes anything, naming the file and the row; skip sets it
    # aside as malformed (counted in curation), for a public set known to hold a few.
    malformed_rows: MalformedRows = "error"


class SftSourceConfig(_Source):
    """SFT data: the generated tool-call and instruction examples, or chats from a file
    (function-calling / instruction-following sets as OpenAI-style message lists)."""

    format: Literal["generated", "jsonl", "parquet"] = "generated"
    messages: str = "messages"  # column with the chat: [{role, content, tool_calls?}]
    tools: str | None = "tools"  # column with the chat's tool schemas (a list, or JSON text)


SftMode = Literal["non_reasoning", "reasoning"]


class SftConfig(_Strict):
    sources: list[SftSourceConfig] = [SftSourceConfig(name="generated")]
    n_examples: int = Field(2000, ge=0)  # of the generated source
    # What the generated source teaches (tasks/data/chat_examples.py): non_reasoning (the paper)
    # or reasoning (programs solving problems of the RL kinds; the cold-start experiment's other arm)
    mode: SftMode = "non_reasoning"
    # Of the generated tool-call examples, the share whose first call fails (half malformed, half
    # a failing program) and is corrected; the failed call is context, not a target. Without
    # them the tiny policy answers at once after a failed call, so its positives carry no tool
    # errors for RoC to filter (0.1%); with 0.3 (the tiny default), 7-9% do.
    recovery_share: float = Field(0.0, ge=0.0, le=1.0)
    # The tiny model only: this share of the SFT samples replays its pre-training documents (the
    # layouts of model.tiny.pretrain_layouts), so that SFT on other tasks' templates does not
    # overwrite the problem -> program ability the base model has (a real base model's is too
    # broad for a short SFT to erase).
    replay_share: float = Field(0.0, ge=0.0, lt=1.0)
    epochs: int = Field(3, ge=1)
    batch_size: int = Field(32, ge=1)
    max_len: int = Field(512, ge=2)
    optim: OptimConfig = OptimConfig(lr=5e-6, schedule="cosine", warmup_steps=0)
    warmup_ratio: float = Field(0.04, ge=0, le=1)


class RolloutConfig(_Strict):
    tool_name: str = "execute_python_code_with_standard_io"  # release: python_code_with_standard_io
    tool_spec: Literal["schema", "compact"] = "schema"  # how the system prompt lists the tool
    temperature: float = Field(1.0, ge=0)
    top_p: float = Field(1.0, gt=0, le=1)
    tool_response_chars: int = Field(256, ge=1)  # release keeps 256 characters around a middle cut

    def spec(self, budget: RolloutBudget) -> RolloutSpec:
        """The sampling settings of the run's rollouts within one budget (a stage's, the
        consensus filter's or evaluation's)."""
        return RolloutSpec(
            budget.max_turns,
            budget.max_response_tokens,
            budget.temperature,
            self.top_p,
            self.tool_name,
            self.tool_response_chars,
            self.tool_spec,
        )


class StageConfig(RolloutBudget):
    # A folder and hive-partition name (runs/<id>/models/<name>, rollouts/stage=<name>/), next to
    # the base and sft policies.
    name: str = Field(pattern=r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")
    steps: int = Field(ge=1)
    problems_per_step: int = Field(ge=1)
    hard_only: bool = False  # keep only problems the current policy does not solve k of k
    difficulty_attempts: int = Field(8, ge=1)
    reset_optimizer: bool = False


class RLConfig(_Strict):
    group_size: int = Field(16, ge=1)  # G kept per problem; 2G are drawn unless roc.mode is off
    roc: RocConfig = RocConfig()
    loss: LossConfig = LossConfig()
    optim: OptimConfig = OptimConfig()
    # `async` in YAML (a Python keyword, hence the field's name)
    overlap: AsyncConfig = Field(AsyncConfig(), alias="async")
    stages: list[StageConfig]
    # DeepSpeed checkpoints kept per stage (one is written every step); 2 lets a run resume from
    # its last recorded step even when it was killed after writing the next step's checkpoint.
    checkpoint_keep: int = Field(2, ge=2)

    model_config = ConfigDict(extra="forbid", populate_by_name=True, serialize_by_alias=True)

    @model_validator(mode="after")
    def _off_policy_needs_correction(self) -> RLConfig:
        if self.overlap.mode != "off" and self.loss.is_cap is None:
            raise ValueError(
                f"rl.async.mode {self.overlap.mode!r} trains on rollouts drawn by older weights: set "
                "rl.loss.is_cap (e.g. 2.0), the truncated importance-sampling correction they need"
            )
        return self

    @field_validator("stages")
    @classmethod
    def _distinct_stage_names(cls, stages: list[StageConfig]) -> list[StageConfig]:
        names = [s.name for s in stages]
        clashes = sorted({n for n in names if names.count(n) > 1 or n in ("base", "sft")})
        if clashes:
            raise ValueError(f"RL stage names must be distinct and not 'base' or 'sft': {clashes}")
        return stages

    @property
    def rollouts_per_problem(self) -> int:
        return self.group_size if self.roc.mode == "off" else 2 * self.group_size

    @property
    def total_steps(self) -> int:
        return sum(stage.steps for stage in self.stages)

    def previous_stage(self, name: str) -> str | None:
        names = [s.name for s in self.stages]
        return names[names.index(name) - 1] if names.index(name) > 0 else None

    def stages_to_run(self, names: list[str] | None, finished: set[str]) -> list[StageConfig]:
        """The stages to (re)run: `names` (every stage when None), in config order. A stage starts
        from the policy its predecessor left, so every earlier stage not listed must be in
        `finished`."""
        known = [s.name for s in self.stages]
        if names is None:
            return list(self.stages)
        if unknown := [n for n in names if n not in known]:
            raise ValueError(f"stages {unknown} are not in the config's rl.stages {known}")
        first = min(known.index(n) for n in names) if names else len(known)
        if missing := [n for n in known[:first] if n not in finished]:
            raise ValueError(
                f"the run has not finished stages {missing}, which come before {names}: "
                f"run them first (stages={missing + list(names)})"
            )
        return [s for s in self.stages if s.name in names]


class EvalConfig(RolloutBudget):
    k: int = Field(16, ge=1)  # avg@k pass@1
    temperature: float = Field(0.6, ge=0)  # release evaluated greedily, which makes avg@16 one sample
    max_turns: int = Field(30, ge=1)  # release capped at 5
    max_response_tokens: int = Field(30000, ge=1)
    n_problems: int | None = Field(None, ge=1)  # None: the whole held-out split
    # false: skip the base model (later, if wanted: rstar2 evaluate --run-id <id> --checkpoint base). The
    # tiny default's is trained from scratch without the chat format, so scores 0 by design.
    base: bool = True


class RunConfig(_Strict):
    name: str = "tiny"
    seed: int = Field(0, ge=0)
    output_dir: str = "outputs"
    model: ModelConfig = ModelConfig()
    data: DataConfig = DataConfig()
    sft: SftConfig = SftConfig()
    rollout: RolloutConfig = RolloutConfig()
    rl: RLConfig
    eval: EvalConfig = EvalConfig()
    # The actor roles, each with its count, resources, restarts and own settings, and the cluster
    # they meet on.
    trainer: TrainerConfig = TrainerConfig()
    engines: EnginesConfig = EnginesConfig()
    sandbox: SandboxConfig = SandboxConfig()
    cluster: ClusterConfig = ClusterConfig()

    @model_validator(mode="after")
    def _budget_temperatures(self) -> RunConfig:
        budgets = [*self.rl.stages, self.eval] + ([self.data.consensus] if self.data.consensus else [])
        for budget in budgets:
            if budget.temperature is None:
                budget.temperature = self.rollout.temperature
        return self

    @model_validator(mode="after")
    def _importance_weights_over_the_whole_vocabulary(self) -> RunConfig:
        # The engine reports log-probs renormalised over the top-p nucleus, the trainer over the
        # whole vocabulary: pi/mu would be biased low on every token.
        if self.rl.loss.is_cap is not None and self.rollout.top_p < 1:
            raise ValueError(
                f"rollout.top_p {self.rollout.top_p} with rl.loss.is_cap: importance weights need log-probs "
                "over the whole vocabulary; sample with top_p 1.0, or leave is_cap unset"
            )
        return self

    @model_validator(mode="after")
    def _lengths_fit(self) -> RunConfig:
        longest = max([s.max_response_tokens for s in self.rl.stages] + [self.eval.max_response_tokens])
        if longest >= self.engines.max_model_len:
            raise ValueError(
                f"engines.max_model_len ({self.engines.max_model_len}) must exceed the longest "
                f"response budget ({longest}) plus the prompt"
            )
        return self


class InputError(ValueError):
    """Bad input to a run (config, data, model, cluster): the message is one line naming what and where."""


class ConfigError(InputError):
    pass


def describe_error(exc: ValidationError) -> str:
    """Pydantic's first error on one line: 'rl.stages.0.steps: Input should be ... (got 'abc')',
    and how many more there are."""
    first, more = exc.errors()[0], exc.error_count() - 1
    field = ".".join(str(part) for part in first["loc"])  # empty for a check across fields
    value = first.get("input")
    scalar = value is None or isinstance(value, str | int | float | bool)  # not a whole section
    got = f" (got {repr(value)[:60]})" if scalar and first["type"] != "missing" else ""
    message = first["msg"].removeprefix("Value error, ")
    return f"{field + ': ' if field else ''}{message}{got}{f' (and {more} more)' if more else ''}"


def _override(raw: dict, dotted: str, value: Any, path: Path) -> None:
    """Set a dotted key in the raw YAML tree; a number indexes a list ("rl.stages.0.steps")."""
    node: Any = raw
    *parents, leaf = dotted.split(".")
    try:
        for key in parents:
            node = node[int(key)] if isinstance(node, list) else node.setdefault(key, {})
        node[int(leaf) if isinstance(node, list) else leaf] = value
    except (AttributeError, IndexError, TypeError, ValueError):
        raise ConfigError(f"{path}: {dotted}: no such field to override") from None


# Keys that have moved, and where to: a config or an override naming one is refused with one line
# saying where the setting lives now. A section that moved names its keys' new section.
MOVED = {
    "engine": "engines",
    "cluster.engines": "engines",
    "cluster.trainer": "trainer",
    "cluster.sandbox": "sandbox",
    "trainer_threads": "trainer.threads",
    "rl.optim.zero_stage": "trainer.zero_stage",
    "sft.optim.zero_stage": "trainer.zero_stage",
    "sandbox.timeout_s": "sandbox.program_timeout_s",
    "sandbox.outage_s": "sandbox.outage_timeout_s",
    "cluster.sync_bucket_mb": "cluster.weight_sync_bucket_mb",
    "cluster.sync_timeout_s": (
        "cluster.weight_sync_timeout_s (a trainer call: trainer.call_timeout_s; loading a policy: "
        "engines.load_timeout_s)"
    ),
    "cluster.ready_timeout_s": "cluster.startup_timeout_s",
    "model.parameters_b": "model.shape (the model's config.json fields: hidden_size, num_hidden_layers, ...)",
}


def _refuse_moved(raw: dict, path: Path) -> None:
    for old, new in MOVED.items():
        node: Any = raw
        for key in old.split("."):
            node = node.get(key) if isinstance(node, dict) else None
        if node is None:
            continue
        if isinstance(node, dict) and node and "." not in new:  # a whole section: name a key of it
            key = next(iter(node))
            raise ConfigError(f"{path}: {old}.{key} has moved to {new}.{key}")
        raise ConfigError(f"{path}: {old} has moved to {new}")


def load_config(path: str | Path, overrides: dict | None = None) -> RunConfig:
    """Load and validate a YAML config; `overrides` are dotted keys, e.g. {"rl.roc.mode": "off"}.
    ConfigError's message is one line: the file, the field, what is wrong."""
    path = Path(path)
    try:
        raw = yaml.safe_load(path.read_text()) or {}
    except yaml.MarkedYAMLError as exc:
        where = f", line {exc.problem_mark.line + 1}" if exc.problem_mark else ""
        raise ConfigError(f"{path}{where}: not YAML: {exc.problem}") from None
    except (OSError, yaml.YAMLError) as exc:
        raise ConfigError(f"cannot read config {path}: {exc}") from exc
    for dotted, value in (overrides or {}).items():
        _override(raw, dotted, value, path)
    _refuse_moved(raw, path)
    try:
        return RunConfig.model_validate(raw)
    except ValidationError as exc:
        raise ConfigError(f"{path}: {describe_error(exc)}") from exc  # the full detail stays in a traceback


def default_config_path() -> Path:
    return Path(__file__).resolve().parents[2] / "configs" / "tiny.yaml"


__all__ = [
    "RunConfig",
    "ModelConfig",
    "PretrainLayouts",
    "TinyModelConfig",
    "StageConfig",
    "TrainerConfig",
    "EnginesConfig",
    "SandboxConfig",
    "ConfigError",
    "InputError",
    "load_config",
    "default_config_path",
]
