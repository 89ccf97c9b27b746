"""Problem sources on disk: Parquet, JSONL and Hugging Face datasets saved with `save_to_disk`,
read through a column mapping so that public data sets load without code changes.

A mapping names a column, or a path into nested values: `prompt.0.content` is the content of the
first message of DAPO-Math-17k's `prompt` list, `reward_model.ground_truth` its label. A missing
column or an unreadable file stops with one error naming the file and the column; a bad row
(missing or empty problem, missing answer, wrong types) is set aside with its row id and why.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq


class SourceError(ValueError):
    """A source that cannot be read at all (file, format or column)."""


@dataclass(frozen=True)
class RawProblem:
    row_id: str  # "<source>:<id column or row number>", stable across runs
    source: str
    question: str
    answer: str  # as written in the source; the integer filter parses it


@dataclass(frozen=True)
class Rejected:
    row_id: str
    source: str
    stage: str  # "malformed" or the name of the curation filter that removed the row
    reason: str


_MISSING = object()


def _lookup(record: Any, path: str) -> Any:
    value = record
    for part in path.split("."):
        if isinstance(value, dict):
            value = value.get(part, _MISSING)
        elif isinstance(value, list | tuple) and part.lstrip("-").isdigit() and -len(value) <= int(part) < len(value):
            value = value[int(part)]
        else:
            return _MISSING
        if value is _MISSING:
            return _MISSING
    return value


def read_records(fmt: str, path: Path, split: str | None = None) -> tuple[list[str] | None, Iterator[dict]]:
    """(top-level column names where the format has a schema, records)."""
    if not path.exists():
        raise SourceError(f"{path}: no such file or directory")
    try:
        if fmt == "parquet":
            table = pq.read_table(path)
            return table.column_names, iter(table.to_pylist())
        if fmt == "hf_disk":
            table = _read_saved_dataset(path / split if split else path)
            return table.column_names, iter(table.to_pylist())
        if fmt == "jsonl":
            return None, _jsonl(path)
    except (OSError, pa.ArrowException, json.JSONDecodeError) as exc:
        raise SourceError(f"{path}: cannot read as {fmt}: {exc}") from None
    raise SourceError(f"{path}: unknown format {fmt!r}")


def _jsonl(path: Path) -> Iterator[dict]:
    with path.open(encoding="utf-8") as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as exc:
                raise SourceError(f"{path}, line {number}: not JSON: {exc}") from None
            if not isinstance(record, dict):
                raise SourceError(f"{path}, line {number}: a JSON object per line expected")
            yield record


def _read_saved_dataset(directory: Path) -> pa.Table:
    """A `Dataset.save_to_disk` directory: Arrow stream files listed in state.json."""
    state_path = directory / "state.json"
    if not state_path.exists():
        splits = [p.name for p in directory.iterdir() if (p / "state.json").exists()] if directory.is_dir() else []
        hint = f" (it holds the splits {splits}: set `split`)" if splits else ""
        raise SourceError(f"{directory}: not a dataset saved with save_to_disk, no state.json{hint}")
    state = json.loads(state_path.read_text())
    tables = []
    for entry in state.get("_data_files", []):
        with pa.memory_map(str(directory / entry["filename"])) as source:
            tables.append(pa.ipc.open_stream(source).read_all())
    if not tables:
        raise SourceError(f"{directory}: state.json lists no data files")
    return pa.concat_tables(tables)


def load_source(
    name: str,
    fmt: str,
    path: Path,
    problem: str,
    answer: str,
    id_column: str | None = None,
    split: str | None = None,
    limit: int | None = None,
) -> tuple[list[RawProblem], list[Rejected]]:
    """The source's usable rows, and its malformed ones with the reason."""
    columns, records = read_records(fmt, Path(path), split)
    wanted = [c for c in (problem, answer, id_column) if c]
    if columns is not None:
        for column in wanted:
            if column.split(".")[0] not in columns:
                raise SourceError(
                    f"{path}: no column {column.split('.')[0]!r} (needed for {column!r}); its columns: {columns}"
                )
    rows: list[RawProblem] = []
    rejected: list[Rejected] = []
    seen_columns: set[str] = set()
    for number, record in enumerate(records):
        if limit is not None and len(rows) >= limit:
            break
        seen_columns.update(record)
        key = _lookup(record, id_column) if id_column else number
        row_id = f"{name}:{number if key is _MISSING or key is None else key}"
        question, label = _lookup(record, problem), _lookup(record, answer)
        reason = None
        if question is _MISSING or question is None:
            reason = f"missing problem ({problem})"
        elif not isinstance(question, str):
            reason = f"problem ({problem}) is {type(question).__name__}, not text"
        elif not question.strip():
            reason = f"empty problem ({problem})"
        elif label is _MISSING or label is None or (isinstance(label, str) and not label.strip()):
            reason = f"missing answer ({answer})"
        elif isinstance(label, bool) or not isinstance(label, str | int | float):
            reason = f"answer ({answer}) is {type(label).__name__}, not a number or text"
        if reason:
            rejected.append(Rejected(row_id, name, "malformed", reason))
        else:
            rows.append(RawProblem(row_id, name, question, str(label)))
    if columns is None and (rows or rejected):
        for column in wanted:
            if column.split(".")[0] not in seen_columns:
                raise SourceError(
                    f"{path}: no row has the key {column.split('.')[0]!r} (needed for {column!r}); "
                    f"keys seen: {sorted(seen_columns)}"
                )
    return rows, rejected
