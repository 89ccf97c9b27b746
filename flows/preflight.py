"""What a run reads, checked before it writes anything: `rstar2 run` and the pipeline flow call
`check_run` before the run folder and its MLflow run exist. Each failure is an InputError whose
message is one line naming what and where (the config field, the file and row, the directory, the
Ray address); nothing here writes.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable
from pathlib import Path

from tasks.cluster.plan import build_plan
from tasks.cluster.resources import run_resources
from tasks.config import InputError, RunConfig
from tasks.data.chat_examples import file_chats
from tasks.data.problem_sets import file_rows

WEIGHTS = ("*.safetensors", "pytorch_model*.bin")  # sharded or not; an index lists these


def check_model(path: str | None) -> None:
    """model.path, where set: a Hugging Face model directory with its config.json and weights."""
    if path is None:
        return
    directory = Path(path)
    if not directory.is_dir():
        raise InputError(f"model.path: {directory}: no such directory")
    if not (directory / "config.json").is_file():
        raise InputError(f"model.path: {directory}: no config.json (not a Hugging Face model directory)")
    if not any(next(directory.glob(pattern), None) for pattern in WEIGHTS):
        raise InputError(f"model.path: {directory}: no weights ({' or '.join(WEIGHTS)})")


def _read_through(items: Iterable) -> None:
    deque(items, maxlen=0)  # every row read and dropped: a large file is never held


def check_data(cfg: RunConfig) -> None:
    """Every row of every file source (problems, benchmarks, SFT chats): a missing file or column,
    or under data.malformed_rows: error a row without its problem or answer, raises SourceError."""
    for source in [*cfg.data.sources, *cfg.data.benchmarks]:
        if source.format != "generated":
            _read_through(file_rows(source, cfg.data.malformed_rows))
    for source in cfg.sft.sources:
        if source.format != "generated":
            _read_through(file_chats(source, cfg))


def check_run(cfg: RunConfig) -> None:
    """InputError where the run would fail on its input, cheapest check first: the model
    directory, the placement plan on the cluster the run would use (connecting to it where
    cluster.address or $RAY_ADDRESS names one), then every data file."""
    check_model(cfg.model.path)
    build_plan(cfg, run_resources(cfg.cluster))
    check_data(cfg)
