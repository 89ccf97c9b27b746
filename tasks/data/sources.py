"""Problem sources on disk: Parquet, JSONL and Hugging Face datasets saved with `save_to_disk`,
read through a column mapping so that public data sets load without code changes.

A mapping names a column, or a path into nested values: `prompt.0.content` is the content of the
first message of DAPO-Math-17k's `prompt` list, `reward_model.ground_truth` its label. A missing
column or an unreadable file stops with one error naming the file and the column; so does a bad
row (missing or empty problem, missing answer, wrong types), naming the row too, unless the
caller asks for such rows to be set aside with their row id and why (`data.malformed_rows`).
Files are read a batch of rows at a time, only the columns the mapping names where the format
allows.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from tasks.config import InputError, MalformedRows


class SourceError(InputError):
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


def read_records(
    fmt: str, path: Path, split: str | None = None, columns: list[str] | None = None
) -> tuple[list[str] | None, Iterator[dict]]:
    """(top-level column names where the format has a schema, records). `columns`: the top-level
    columns a caller needs; the others are left unread where the format allows (not JSONL)."""
    if not path.exists():
        raise SourceError(f"{path}: no such file or directory")
    try:
        if fmt == "parquet":
            file = pq.ParquetFile(path)
            names = file.schema_arrow.names
            return names, _rows(file.iter_batches(columns=_present(columns, names)), path, fmt)
        if fmt == "hf_disk":
            table = _read_saved_dataset(path / split if split else path)
            names = table.column_names
            return names, _rows(table.select(_present(columns, names) or names).to_batches(), path, fmt)
        if fmt == "jsonl":
            return None, _jsonl(path)
    except (OSError, pa.ArrowException, json.JSONDecodeError) as exc:
        raise SourceError(f"{path}: cannot read as {fmt}: {exc}") from None
    raise SourceError(f"{path}: unknown format {fmt!r}")


def _present(columns: list[str] | None, names: list[str]) -> list[str] | None:
    return None if columns is None else [c for c in names if c in columns]


def _rows(batches: Iterator[pa.RecordBatch], path: Path, fmt: str) -> Iterator[dict]:
    """One batch in memory at a time: a large file's other rows stay on disk."""
    try:
        for batch in batches:
            yield from batch.to_pylist()
    except (OSError, pa.ArrowException) as exc:
        raise SourceError(f"{path}: cannot read as {fmt}: {exc}") from None


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


def malformed_row(path: Path, number: int, reason: str, key: Any = None) -> SourceError:
    """The one-line error for a malformed row under `error`, naming the file, the row (its id
    where the source has an id column) and the column."""
    row = f"row {number}" + (f" (id {key})" if key not in (None, number) else "")
    return SourceError(f"{path}, {row}: {reason}; data.malformed_rows: skip sets such rows aside")


def partition(items: Iterable[Any]) -> tuple[list[Any], list[Rejected]]:
    """(the usable items, the rejected ones) of a reader's stream."""
    kept, rejected = [], []
    for item in items:
        (rejected if isinstance(item, Rejected) else kept).append(item)
    return kept, rejected


def load_source(*args, **kwargs) -> tuple[list[RawProblem], list[Rejected]]:
    """The source's usable rows, and its malformed ones with the reason (`read_rows`' arguments)."""
    return partition(read_rows(*args, **kwargs))


def read_rows(
    name: str,
    fmt: str,
    path: Path,
    problem: str,
    answer: str,
    id_column: str | None = None,
    split: str | None = None,
    limit: int | None = None,
    malformed: MalformedRows = "error",
) -> Iterator[RawProblem | Rejected]:
    """The source's rows one at a time, in file order: each usable one, and each malformed one
    with its reason; under `malformed="error"` a SourceError naming the first malformed one once
    the file is read (a column no row has is the likelier mistake, and is named instead)."""
    wanted = [c for c in (problem, answer, id_column) if c]
    columns, records = read_records(fmt, Path(path), split, [c.split(".")[0] for c in wanted])
    if columns is not None:
        for column in wanted:
            if column.split(".")[0] not in columns:
                raise SourceError(
                    f"{path}: no column {column.split('.')[0]!r} (needed for {column!r}); its columns: {columns}"
                )
    usable, read, first_malformed = 0, 0, None
    seen_columns: set[str] = set()
    for number, record in enumerate(records):
        if limit is not None and usable >= limit:
            break
        read += 1
        seen_columns.update(record)
        key = _lookup(record, id_column) if id_column else number
        key = number if key is _MISSING or key is None else key
        row_id = f"{name}:{key}"
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
        if reason and malformed == "error":
            first_malformed = first_malformed or malformed_row(path, number, reason, key)
        elif reason:
            yield Rejected(row_id, name, "malformed", reason)
        else:
            usable += 1
            yield RawProblem(row_id, name, question, str(label))
    if columns is None and read:
        for column in wanted:
            if column.split(".")[0] not in seen_columns:
                raise SourceError(
                    f"{path}: no row has the key {column.split('.')[0]!r} (needed for {column!r}); "
                    f"keys seen: {sorted(seen_columns)}"
                )
    if first_malformed:
        raise first_malformed
