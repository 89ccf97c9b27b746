"""Curation filters (recipe.md section 1): pure functions over problem rows.

Each filter takes the rows that survived the previous one and returns (kept, rejected), every
rejection with its row id and why, so curation can report how many rows each removed.
Order: integer answers -> huge answers -> exact duplicates -> near duplicates -> n-gram
decontamination against the evaluation sets.
"""

from __future__ import annotations

import random
import re
import unicodedata
import zlib
from dataclasses import replace

from tasks.data.sources import RawProblem, Rejected

_BOXED = re.compile(r"^\\boxed\{(.*)\}$")
_INTEGER = re.compile(r"^[+-]?\d+$")
_GROUPED = re.compile(r"^[+-]?\d{1,3}(,\d{3})+$")  # 1,234,567
_WORD = re.compile(r"\w+")
_NUMBER = re.compile(r"\d+")


def normalize_text(text: str) -> str:
    return " ".join(unicodedata.normalize("NFKC", text).split())


def parse_integer(answer: str) -> int | None:
    """The integer an answer states ("42", "$-7$", "\\boxed{1,024}", "12.0"), else None."""
    text = normalize_text(answer).strip("$ ").rstrip(".")
    match = _BOXED.match(text)
    if match:
        text = match.group(1).strip()
    text = text.replace("\\,", ",").replace("\\!", "")
    if _GROUPED.match(text):
        text = text.replace(",", "")
    text = re.sub(r"^([+-]?\d+)\.0+$", r"\1", text)
    return int(text) if _INTEGER.match(text) else None


def _partition(rows: list[RawProblem], stage: str, reason_of) -> tuple[list[RawProblem], list[Rejected]]:
    """Rows where `reason_of(row)` is None are kept; the others are rejected with that reason."""
    kept, rejected = [], []
    for row in rows:
        reason = reason_of(row)
        if reason is None:
            kept.append(row)
        else:
            rejected.append(Rejected(row.row_id, row.source, stage, reason))
    return kept, rejected


def integer_answers(rows: list[RawProblem]) -> tuple[list[RawProblem], list[Rejected]]:
    kept, rejected = _partition(
        rows,
        "integer",
        lambda row: None if parse_integer(row.answer) is not None else f"answer {row.answer[:40]!r} is not an integer",
    )
    return [
        replace(r, question=normalize_text(r.question), answer=str(parse_integer(r.answer))) for r in kept
    ], rejected


def small_answers(rows: list[RawProblem], max_digits: int) -> tuple[list[RawProblem], list[Rejected]]:
    """Drop answers of more than `max_digits` digits: a label that long is more often a
    formatting accident than a result, and verifying it rewards copying digits."""

    def reason_of(row: RawProblem) -> str | None:
        digits = len(row.answer.lstrip("+-"))
        return f"answer has {digits} digits > {max_digits}" if digits > max_digits else None

    return _partition(rows, "huge_answer", reason_of)


def _key(question: str) -> str:
    return " ".join(_WORD.findall(question.lower()))


def exact_duplicates(rows: list[RawProblem]) -> tuple[list[RawProblem], list[Rejected]]:
    """Same text up to case, spacing and punctuation: the first occurrence stays."""
    first: dict[str, str] = {}

    def reason_of(row: RawProblem) -> str | None:
        key = _key(row.question)
        if key in first:
            return f"same text as {first[key]}"
        first[key] = row.row_id
        return None

    return _partition(rows, "exact_duplicate", reason_of)


def _shingles(text: str, size: int = 5) -> set[str]:
    text = _key(text)
    return {text[i : i + size] for i in range(max(1, len(text) - size + 1))}


def _jaccard(a: set[str], b: set[str]) -> float:
    return len(a & b) / len(a | b) if a or b else 1.0


_PRIME = (1 << 61) - 1


def near_duplicates(
    rows: list[RawProblem], threshold: float, bands: int = 16, rows_per_band: int = 4, seed: int = 0
) -> tuple[list[RawProblem], list[Rejected]]:
    """Character 5-gram Jaccard similarity >= `threshold` to an earlier kept row with the same
    numbers. MinHash with
    banding proposes candidate pairs (deterministic hashes: same result every run); each
    candidate is confirmed with the exact Jaccard similarity."""
    rng = random.Random(seed)
    perms = [(rng.randrange(1, _PRIME), rng.randrange(_PRIME)) for _ in range(bands * rows_per_band)]
    buckets: dict[tuple[int, tuple[int, ...]], list[int]] = {}
    kept: list[RawProblem] = []
    kept_shingles: list[set[str]] = []
    kept_numbers: list[list[str]] = []
    rejected = []
    for row in rows:
        shingles = _shingles(row.question)
        base = [zlib.crc32(s.encode()) for s in shingles]
        signature = [min((a * h + b) % _PRIME for h in base) for a, b in perms]
        keys = [(band, tuple(signature[band * rows_per_band : (band + 1) * rows_per_band])) for band in range(bands)]
        candidates = {i for key in keys for i in buckets.get(key, ())}
        numbers = sorted(_NUMBER.findall(row.question))
        # The same problem up to wording has the same numbers; templated problems that differ
        # only in a number are different problems.
        match = next(
            (
                i
                for i in sorted(candidates)
                if kept_numbers[i] == numbers and _jaccard(shingles, kept_shingles[i]) >= threshold
            ),
            None,
        )
        if match is not None:
            similarity = _jaccard(shingles, kept_shingles[match])
            rejected.append(
                Rejected(row.row_id, row.source, "near_duplicate", f"{similarity:.2f} similar to {kept[match].row_id}")
            )
            continue
        for key in keys:
            buckets.setdefault(key, []).append(len(kept))
        kept.append(row)
        kept_shingles.append(shingles)
        kept_numbers.append(numbers)
    return kept, rejected


def decontaminate(
    rows: list[RawProblem], evaluation: list[RawProblem], n: int = 8
) -> tuple[list[RawProblem], list[Rejected]]:
    """Drop training problems that share a word n-gram with an evaluation problem (the whole
    text, for problems shorter than n words)."""

    def grams(text: str) -> set[tuple[str, ...]]:
        words = _WORD.findall(text.lower())
        return {tuple(words[i : i + n]) for i in range(len(words) - n + 1)} if len(words) >= n else {tuple(words)}

    owner: dict[tuple[str, ...], str] = {}
    for row in evaluation:
        for gram in grams(row.question):
            owner.setdefault(gram, row.row_id)

    def reason_of(row: RawProblem) -> str | None:
        hit = next((owner[g] for g in grams(row.question) if g in owner), None)
        return None if hit is None else f"shares a {n}-gram with {hit}"

    return _partition(rows, "decontamination", reason_of)


def curate_rows(
    rows: list[RawProblem],
    evaluation: list[RawProblem],
    max_answer_digits: int,
    near_duplicate_threshold: float,
    ngram: int,
) -> tuple[list[RawProblem], list[Rejected], list[dict]]:
    """All filters in order; (kept, rejected, one count row per filter)."""
    steps = [
        ("integer", integer_answers),
        ("huge_answer", lambda r: small_answers(r, max_answer_digits)),
        ("exact_duplicate", exact_duplicates),
        ("near_duplicate", lambda r: near_duplicates(r, near_duplicate_threshold)),
        ("decontamination", lambda r: decontaminate(r, evaluation, ngram)),
    ]
    rejected: list[Rejected] = []
    counts = []
    for name, step in steps:
        before = len(rows)
        rows, removed = step(rows)
        rejected += removed
        counts.append({"filter": name, "in": before, "removed": len(removed), "kept": len(rows)})
    return rows, rejected, counts
