"""A run's folder and what it records about itself: which run it is, where each kind of output
lies, and the finished-stage records that make a rerun skip work already done.

The run's identity is decided here, and only here: a run id names a folder, its config.json says
what the run computes, and a resume may change only where the run's actors go (PLACEMENT), so a
run can go on on another cluster, on fewer nodes after a loss, or with more ranks. MLflow records
what this module decided (tasks/tracking/mlflow_log.py).

    <output_dir>/runs/<run_id>/
        config.json                 the validated config (a resume may change its placement only)
        state/<stage>.json          a finished stage's result; wall.json: seconds per stage
        data/ models/ checkpoints/  curated splits; base, sft and RL policies; DeepSpeed steps
        rollouts/ steps/ evaluations/   Parquet tables (tasks/store/tables.py)
"""

from __future__ import annotations

import json
import re
import shutil
import time
import uuid
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from tasks.config import RunConfig
from tasks.records import RunContext
from tasks.store.tables import step_part, write_json, write_text

# Where a run's actors go, how long it waits on them and how a step holds its memory, not what the
# run computes: the fields a resumed run may change (another cluster, fewer nodes after a loss,
# more ranks or engines).
PLACEMENT = (
    "cluster",
    *(
        f"trainer.{f}"
        for f in (
            "ranks",
            "cpus",
            "gpus",
            "resources",
            "threads",
            "call_timeout_s",
            "gradient_checkpointing",
            "logit_chunk_tokens",
        )
    ),
    *(f"engines.{f}" for f in ("count", "cpus", "gpus", "resources", "max_restarts", "threads", "load_timeout_s")),
    *(f"sandbox.{f}" for f in ("replicas", "cpus", "resources", "max_restarts", "urls", "workers", "outage_timeout_s")),
)
# What a run starting from another one's policy copies: its records of the stages up to it.
SHARED_STAGES = {"base": ("curate", "base", "eval-base"), "sft": ("curate", "base", "sft", "eval-base", "eval-sft")}
# Config fields runs sharing those stages may differ in (the rest trained the shared policies):
# RL settings, and after SFT where the run's actors sit, how many threads its trainer uses and
# how its engines schedule rollouts (when and where each runs, not what it samples).
SCHEDULING = tuple(f"engines.{f}" for f in ("scheduler", "kv_reserve", "kv_headroom", "kv_overcommit"))
MAY_DIFFER = {"base": ("rl", "sft.mode"), "sft": ("rl", "cluster", "trainer.threads", *SCHEDULING)}


def run_dir(output_dir: str | Path, run_id: str) -> Path:
    return Path(output_dir) / "runs" / run_id


def _without(tree: dict, paths: tuple[str, ...]) -> dict:
    """A copy of a config tree without the dotted `paths`."""
    tree = json.loads(json.dumps(tree))
    for path in paths:
        *parents, leaf = path.split(".")
        node = tree
        for key in parents:
            node = node.get(key, {})
        node.pop(leaf, None)
    return tree


def changed_fields(old: dict, new: dict, prefix: str = "") -> list[str]:
    """The dotted paths where two config trees differ (a list that differs, by its own path)."""
    changed = []
    for key in sorted(old.keys() | new.keys()):
        a, b = old.get(key), new.get(key)
        if isinstance(a, dict) and isinstance(b, dict):
            changed += changed_fields(a, b, f"{prefix}{key}.")
        elif a != b:
            changed.append(f"{prefix}{key}")
    return changed


def open_run(cfg: RunConfig, run_id: str | None) -> tuple[str, Path]:
    """A new run (its id and folder, config.json written), or run `run_id` continued. A run that
    exists may be continued with its placement changed (config.json then records the new one);
    any other change is refused, naming the fields."""
    run_id = run_id or f"{cfg.name}-{time.strftime('%Y%m%d-%H%M%S')}-{uuid.uuid4().hex[:6]}"
    folder = run_dir(cfg.output_dir, run_id)
    recorded = folder / "config.json"
    mine = cfg.model_dump(mode="json")
    if recorded.exists():
        theirs = json.loads(recorded.read_text())
        if changed := changed_fields(_without(theirs, PLACEMENT), _without(mine, PLACEMENT)):
            raise ValueError(
                f"run {run_id} exists in {folder} with another config ({', '.join(changed)} differ): resume it "
                f"with the same config and overrides (only {', '.join(PLACEMENT)} may change), or choose a new run id"
            )
        if moved := changed_fields(theirs, mine):
            print(f"run {run_id}: resuming with a new placement ({', '.join(moved)})")
    folder.mkdir(parents=True, exist_ok=True)
    write_text(cfg.model_dump_json(indent=2), recorded)
    return run_id, folder


def reopen_run(output_dir: str | Path, run_id: str, eval_overrides: dict | None) -> tuple[RunConfig, Path]:
    """An existing run's recorded config, with `eval_overrides` applied to its eval section (the
    only part a later evaluation may change), and its folder."""
    folder = run_dir(output_dir, run_id)
    if not (folder / "config.json").exists():
        runs = sorted(p.parent.name for p in (Path(output_dir) / "runs").glob("*/config.json"))
        raise ValueError(f"no run {run_id!r} under {Path(output_dir) / 'runs'} (runs there: {runs})")
    recorded = RunConfig.model_validate_json((folder / "config.json").read_text())
    try:
        evaluation = recorded.eval.model_validate({**recorded.eval.model_dump(), **(eval_overrides or {})})
    except ValidationError as exc:
        raise ValueError(f"invalid eval_overrides {eval_overrides}:\n{exc}") from exc
    return recorded.model_copy(update={"eval": evaluation}), folder


def finished_result(ctx: RunContext, name: str) -> Any:
    """The recorded result of stage `name`, or None when it has not finished."""
    path = ctx.state_path(name)
    return json.loads(path.read_text())["result"] if path.exists() else None


def record_finished(ctx: RunContext, name: str, result: Any) -> Any:
    """Record stage `name` as finished with its (JSON-able) result; returns the result as a later
    attempt will read it back."""
    path = write_json({"result": result}, ctx.state_path(name))
    return json.loads(path.read_text())["result"]


def saved_policy(ctx: RunContext, name: str) -> Path:
    """The Hugging Face directory of a run's policy `name` (base, sft, or a finished RL stage)."""
    path = ctx.policy_dir(name)
    if not (path / "config.json").exists():
        saved = sorted(p.parent.name for p in (ctx.run_dir / "models").glob("*/config.json"))
        raise ValueError(f"run {ctx.run_id} has no saved policy {name!r} (saved: {saved})")
    return path


def steps_done(ctx: RunContext, stage: str, steps: int) -> list[int]:
    """The steps of an RL stage with a row in the steps table: a step is done once it has one."""
    return [k for k in range(steps) if step_part(ctx.run_dir, "steps", stage, k).exists()]


def checkpoint_tag(step: int) -> str:
    return f"step-{step:05d}"


def universal_copy(directory: Path, tag: str) -> Path:
    """Where checkpoint `tag` is kept in DeepSpeed's universal format, once a resume on another
    number of ranks has converted it (tasks/train/trainer.py)."""
    return directory / f"{tag}-universal"


def prune_checkpoints(directory: Path, keep: int) -> None:
    """Remove all but the newest `keep` step checkpoints, so a long run does not fill the disk,
    each with its universal copy (made when a resume ran on another number of ranks)."""
    tags = sorted(p.name for p in directory.glob("step-*") if re.fullmatch(r"step-\d+", p.name))
    for tag in tags[:-keep]:
        universal = universal_copy(directory, tag)
        for folder in (directory / tag, universal, universal.with_suffix(".tmp")):
            shutil.rmtree(folder, ignore_errors=True)


def start_from_run(source: Path, target: Path, cfg: RunConfig, upto: str = "sft") -> None:
    """Make run folder `target` continue where run `source` stands after its `upto` policy
    (`base` or `sft`): its curated data, policies up to that one, their evaluation rows and
    finished records (paths rewritten). Does nothing when `target` already has a config (a
    comparison being resumed). `cfg` is the target's config: it may differ from the source's only
    in the fields of MAY_DIFFER[upto]."""
    if (target / "config.json").exists():
        return
    allowed = MAY_DIFFER[upto]
    theirs = _without(json.loads((source / "config.json").read_text()), allowed)
    mine = _without(json.loads(cfg.model_dump_json()), allowed)
    if differ := sorted(k for k in theirs.keys() | mine.keys() if theirs.get(k) != mine.get(k)):
        raise ValueError(
            f"run {source.name} cannot seed run {target.name}: their configs differ in {differ}, "
            f"and only {', '.join(allowed)} may (the runs share everything up to the {upto} policy)"
        )
    checkpoints = ("base", "sft")[: ("base", "sft").index(upto) + 1]
    staging = target.with_name(f".{target.name}.partial")
    shutil.rmtree(staging, ignore_errors=True)
    for folder in ("data", *(f"models/{c}" for c in checkpoints)):
        shutil.copytree(source / folder, staging / folder)
    for checkpoint in checkpoints:
        for part in (source / "evaluations").glob(f"checkpoint={checkpoint}/*"):
            shutil.copytree(part, staging / part.relative_to(source))
        for part in (source / "rollouts").glob(f"stage=eval-{checkpoint}*"):
            shutil.copytree(part, staging / part.relative_to(source))
    (staging / "state").mkdir()
    for name in SHARED_STAGES[upto]:
        record = source / "state" / f"{name}.json"
        if name == "eval-base" and not record.exists():  # eval.base: false
            continue
        (staging / "state" / record.name).write_text(record.read_text().replace(str(source), str(target)))
    shutil.rmtree(target, ignore_errors=True)
    staging.rename(target)


def arm_source(runs_dir: Path, name: str, seed: int, arm: str, first_arm: str, sft_from: str | None) -> Path | None:
    """The run a comparison's run `<name>-s<seed>-<arm>` starts from: a seed's later arms from its
    first arm's run; its first arm from ablation `sft_from`'s run of the seed, or from scratch."""
    if arm != first_arm:
        return runs_dir / f"{name}-s{seed}-{first_arm}"
    return sft_run_of(runs_dir, sft_from, seed) if sft_from else None


def sft_run_of(runs_dir: Path, ablation: str, seed: int) -> Path:
    """The run of ablation `ablation` (any mode) that trained seed `seed`'s SFT policy."""
    for run_dir in sorted(runs_dir.glob(f"{ablation}-s{seed}-*")):
        if (run_dir / "state" / "sft.json").exists():
            return run_dir
    raise ValueError(
        f"no run {ablation}-s{seed}-<mode> under {runs_dir} has finished SFT: run "
        f"`rstar2 ablate --name {ablation}` with {seed + 1} seed(s) first"
    )
