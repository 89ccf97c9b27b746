"""The one typed config of a pipeline run, loaded from configs/*.yaml.

Every difference between the paper and the public release is a field here (see the
`roc`, `count_turns`, `tool_name` and evaluation fields), so either can be reproduced
without touching code.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from tasks.config.cluster import ClusterConfig
from tasks.config.model import ModelConfig, PretrainLayouts, TinyModelConfig


class _Strict(BaseModel):
    # A misspelt key in a YAML file must fail loudly, not be silently ignored.
    model_config = ConfigDict(extra="forbid")


class _Source(_Strict):
    """Where examples come from: the generated set, or a file (`path`)."""

    name: str
    path: str | None = None
    limit: int | None = None  # the first rows only

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
    max_turns: int = 10
    max_response_tokens: int = 1024

    @model_validator(mode="after")
    def _m_at_most_n(self) -> ConsensusConfig:
        if self.m > self.n:
            raise ValueError(f"consensus.m ({self.m}) cannot exceed consensus.n ({self.n})")
        return self


MalformedRows = Literal["error", "skip"]  # what a data row without its problem or answer does


class DataConfig(_Strict):
    n_train: int = 512  # generated problems: train + held-out are generated together
    n_heldout: int = 64  # held out of the curated problems, whatever their source
    levels: list[int] = [1, 2, 3]
    seed: int = 0
    sources: list[SourceConfig] = [SourceConfig(name="generated")]
    # Evaluation benchmarks (AIME, MATH-500, ...): decontaminated against, and evaluated on.
    benchmarks: list[SourceConfig] = []
    max_answer_digits: int = 12
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


class OptimConfig(_Strict):
    lr: float = 1e-6
    warmup_steps: int = 20
    schedule: Literal["constant", "cosine"] = "constant"
    weight_decay: float = 0.0
    grad_clip: float = 1.0
    betas: tuple[float, float] = (0.9, 0.999)
    zero_stage: Literal[0, 1, 2, 3] = 2
    micro_batch_size: int = 8


class SftSourceConfig(_Source):
    """SFT data: the generated tool-call and instruction examples, or chats from a file
    (function-calling / instruction-following sets as OpenAI-style message lists)."""

    format: Literal["generated", "jsonl", "parquet"] = "generated"
    messages: str = "messages"  # column with the chat: [{role, content, tool_calls?}]
    tools: str | None = "tools"  # column with the chat's tool schemas (a list, or JSON text)


SftMode = Literal["non_reasoning", "reasoning"]


class SftConfig(_Strict):
    sources: list[SftSourceConfig] = [SftSourceConfig(name="generated")]
    n_examples: int = 2000  # of the generated source
    # What the generated source teaches (tasks/data/chat_examples.py): non_reasoning (the paper)
    # or reasoning (programs solving problems of the RL kinds; the cold-start experiment's other arm)
    mode: SftMode = "non_reasoning"
    # Of the generated tool-call examples, the share whose first call fails (half malformed, half
    # a failing program) and is corrected; the failed call is context, not a target. Without
    # them the tiny policy answers at once after a failed call, so its positives carry no tool
    # errors for RoC to filter (0.1%); with 0.3 (the tiny default), 7-9% do
    # (LOG.md, 2026-11-24 recovery-from-malformed-calls entry).
    recovery_share: float = Field(0.0, ge=0.0, le=1.0)
    # The tiny model only: this share of the SFT samples replays its pre-training documents (the
    # layouts of model.tiny.pretrain_layouts), so that SFT on other tasks' templates does not
    # overwrite the problem -> program ability the base model has (a real base model's is too
    # broad for a short SFT to erase).
    replay_share: float = Field(0.0, ge=0.0, lt=1.0)
    epochs: int = 3
    batch_size: int = 32
    max_len: int = 512
    optim: OptimConfig = OptimConfig(lr=5e-6, schedule="cosine", warmup_steps=0)
    warmup_ratio: float = 0.04


class EngineConfig(_Strict):
    """vLLM engine settings; on CPU the KV cache must always be bounded."""

    kv_cache_gib: float = 0.25
    block_size: int = 32  # the CPU default (128) caches too coarsely for short multi-turn prompts
    max_model_len: int = 2048
    # Eager on the tiny default: torch.compile (vLLM's default; the GPU configs use it) gives a
    # CPU engine 1.2-1.8x the tokens/s (bench/rollout_bench.py), but a default run's rollouts wait
    # on tool calls and the agent loop, not the engine: 990 s compiled vs 915 s eager (LOG.md).
    enforce_eager: bool = True
    tensor_parallel_size: int = 1
    max_num_seqs: int = 256
    gpu_memory_utilization: float = 0.85  # used on GPUs only
    # CPU only: OpenMP threads per engine, each engine actor bound to its own block of cores
    # (cluster.engines.count says how many engines). Two
    # engines of one thread give 1.1-1.6x one, one engine of two threads 0.7-0.9x two of one:
    # most of a tiny model's step is vLLM's Python bookkeeping (bench/rollout_bench.py).
    threads: int = Field(1, ge=1)
    # kv_aware: admit per engine only what its KV cache holds at full length (the paper's
    # scheduler, never released); static: split every rollout evenly up front (the baseline).
    scheduler: Literal["kv_aware", "static"] = "kv_aware"
    # What kv_aware sets aside per rollout. max_length: prompt + the whole response budget (the
    # paper; no engine can overflow). observed (ours): kv_headroom x the mean size of the
    # previous batch's rollouts. bench/scheduler_sim.py, 3 seeds, at 419K KV tokens an engine
    # (Qwen3-14B in the paper config's 64 GiB): steps 27-32% shorter than static (the paper's
    # rule: 7-14%), no preemptions; at 850K (a whole 192 GB GPU) 3-5% longer than static (the
    # paper's: 19-22%). On the tiny CPU pool both lose to static (bench/rollout_bench.py; docs/benchmarks.md).
    kv_reserve: Literal["max_length", "observed"] = "max_length"
    kv_headroom: float = Field(1.3, ge=1.0)


class SandboxConfig(_Strict):
    urls: list[str] = []  # empty: the pipeline starts a local service and stops it at the end
    workers: int = 4
    timeout_s: float = 4.0  # release default
    memory_mb: int = 256  # release default
    output_bytes: int = 1000  # release truncates at the service to 1000 characters
    # No replica answering for this long fails the attempt (their node is gone for good) rather
    # than train on calls that all came back `internal`.
    outage_s: float = Field(300.0, gt=0)


class RolloutConfig(_Strict):
    tool_name: str = "execute_python_code_with_standard_io"  # release: python_code_with_standard_io
    tool_spec: Literal["schema", "compact"] = "schema"  # how the system prompt lists the tool
    temperature: float = 1.0
    top_p: float = 1.0
    tool_response_chars: int = 256  # release keeps 256 characters around a middle cut


class RocConfig(_Strict):
    mode: Literal["paper", "release", "off"] = "paper"
    count_turns: Literal["all", "after_first_tool"] = "all"  # release: after_first_tool
    drop_zero_signal: bool = True


class LossConfig(_Strict):
    eps_low: float = 0.2
    eps_high: float = 0.28
    dual_clip: float = 3.0
    # Scales the loss of rollouts with a negative advantage (the paper: 1). Token-mean sums tokens,
    # and wrong rollouts are the long ones, so at 1 pushing down outweighs pulling up; on the tiny
    # default that raised entropy and tool errors over stage 1 (LOG.md, 2026-11-24 wrong-rollouts-outweighed entry).
    negative_weight: float = Field(1.0, ge=0.0, le=1.0)


class StageConfig(RolloutBudget):
    # A folder and hive-partition name (runs/<id>/models/<name>, rollouts/stage=<name>/), next to
    # the base and sft policies.
    name: str = Field(pattern=r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")
    steps: int
    problems_per_step: int
    hard_only: bool = False  # keep only problems the current policy does not solve k of k
    difficulty_attempts: int = 8
    reset_optimizer: bool = False


class RLConfig(_Strict):
    group_size: int = 16  # G kept per problem; 2G are drawn unless roc.mode is off
    roc: RocConfig = RocConfig()
    loss: LossConfig = LossConfig()
    optim: OptimConfig = OptimConfig()
    stages: list[StageConfig]
    # DeepSpeed checkpoints kept per stage (one is written every step); 2 lets a run resume from
    # its last recorded step even when it was killed after writing the next step's checkpoint.
    checkpoint_keep: int = Field(2, ge=2)

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
    k: int = 16  # avg@k pass@1
    temperature: float = 0.6  # release evaluated greedily, which makes avg@16 one sample
    max_turns: int = 30  # release capped at 5
    max_response_tokens: int = 30000
    n_problems: int | None = None  # None: the whole held-out split
    # false: skip the base model (later, if wanted: rstar2 evaluate --run-id <id> --checkpoint base). The
    # tiny default's is trained from scratch without the chat format, so scores 0 by design.
    base: bool = True


class RunConfig(_Strict):
    name: str = "tiny"
    seed: int = 0
    output_dir: str = "outputs"
    # Training phases run while the engines and the sandbox sit idle, so they may take more
    # threads than one per process (measured on 2 cores: 2 threads, 1.7x faster SFT steps).
    trainer_threads: int = 1
    model: ModelConfig = ModelConfig()
    data: DataConfig = DataConfig()
    sft: SftConfig = SftConfig()
    engine: EngineConfig = EngineConfig()
    sandbox: SandboxConfig = SandboxConfig()
    rollout: RolloutConfig = RolloutConfig()
    rl: RLConfig
    eval: EvalConfig = EvalConfig()
    cluster: ClusterConfig = ClusterConfig()

    @model_validator(mode="after")
    def _budget_temperatures(self) -> RunConfig:
        budgets = [*self.rl.stages, self.eval] + ([self.data.consensus] if self.data.consensus else [])
        for budget in budgets:
            if budget.temperature is None:
                budget.temperature = self.rollout.temperature
        return self

    @model_validator(mode="after")
    def _lengths_fit(self) -> RunConfig:
        longest = max([s.max_response_tokens for s in self.rl.stages] + [self.eval.max_response_tokens])
        if longest >= self.engine.max_model_len:
            raise ValueError(
                f"engine.max_model_len ({self.engine.max_model_len}) must exceed the longest "
                f"response budget ({longest}) plus the prompt"
            )
        return self

    def run_dir(self, run_id: str) -> Path:
        return Path(self.output_dir) / "runs" / run_id


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
    "ConfigError",
    "InputError",
    "load_config",
    "default_config_path",
]
