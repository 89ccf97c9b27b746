"""The run's problem sets: every configured source read and passed through the curation filters
(tasks/data/filters.py), then a seeded train / held-out split, written under the run folder:

    data/train.parquet, data/heldout.parquet   the problems
    data/rejected.parquet                      every row set aside: row id, source, filter, reason
    data/curation.parquet                      rows in / removed / kept per filter

The consensus filter, which needs a policy, runs later and adds its row to the last two.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import asdict
from pathlib import Path

from tasks.config import DataConfig, MalformedRows, SourceConfig
from tasks.data.filters import curate_rows, integer_answers
from tasks.data.problems import generate_problems, split_problems
from tasks.data.sources import RawProblem, Rejected, partition, read_rows
from tasks.records import Problem, Rollouts
from tasks.rollout.metrics import solved_attempts
from tasks.store.tables import CURATION, PROBLEMS, REJECTED, read_table, write_table


def file_rows(source: SourceConfig, malformed: MalformedRows) -> Iterator[RawProblem | Rejected]:
    """A file source's rows one at a time (tasks/data/sources.py)."""
    return read_rows(
        source.name,
        source.format,
        Path(source.path),
        source.problem,
        source.answer,
        source.id,
        source.split,
        source.limit,
        malformed,
    )


def read_source(source: SourceConfig, data: DataConfig) -> tuple[list[RawProblem], list[Rejected], dict[str, Problem]]:
    """(rows, malformed rows, the generated Problems by id, which keep their solution code)."""
    if source.format == "generated":
        problems = generate_problems(data.n_train + data.n_heldout, data.levels, data.seed, data.kinds)
        rows = [RawProblem(p.problem_id, source.name, p.question, p.answer) for p in problems]
        return rows, [], {p.problem_id: p for p in problems}
    rows, rejected = partition(file_rows(source, data.malformed_rows))
    return rows, rejected, {}


def load_benchmark(source: SourceConfig, data: DataConfig) -> list[Problem]:
    """An evaluation set: its well-formed rows with integer answers, as problems."""
    rows, _, generated = read_source(source, data)
    rows, _ = integer_answers(rows)
    return [generated.get(r.row_id) or Problem(r.row_id, r.source, 0, r.question, r.answer, "") for r in rows]


def curate(data: DataConfig, run_dir: Path) -> dict:
    """Every source through the filters, then the split; writes the four tables above under
    run_dir/data and returns their paths and the per-filter counts. A source that cannot be read
    raises before anything is written."""
    rows: list[RawProblem] = []
    rejected: list[Rejected] = []
    generated: dict[str, Problem] = {}
    for source in data.sources:
        source_rows, malformed, source_generated = read_source(source, data)
        rows += source_rows
        rejected += malformed
        generated.update(source_generated)
    evaluation = [
        RawProblem(p.problem_id, p.kind, p.question, p.answer)
        for source in data.benchmarks
        for p in load_benchmark(source, data)
    ]
    malformed = len(rejected)
    kept, removed, counts = curate_rows(
        rows, evaluation, data.max_answer_digits, data.near_duplicate_threshold, data.decontamination_ngram
    )
    counts.insert(0, {"filter": "malformed", "in": len(rows) + malformed, "removed": malformed, "kept": len(rows)})
    rejected += removed
    problems = [generated.get(r.row_id) or Problem(r.row_id, r.source, 0, r.question, r.answer, "") for r in kept]
    if len(problems) <= data.n_heldout:
        raise ValueError(
            f"curation kept {len(problems)} problems, not more than data.n_heldout={data.n_heldout}: "
            f"nothing would be left to train on (see {run_dir / 'data' / 'rejected.parquet'})"
        )
    train, heldout = split_problems(problems, data.n_heldout, data.seed)
    out = run_dir / "data"
    paths = {
        name: write_table([p.to_row() for p in split], PROBLEMS, out / f"{name}.parquet")
        for name, split in (("train", train), ("heldout", heldout))
    }
    paths["rejected"] = write_table([asdict(r) for r in rejected], REJECTED, out / "rejected.parquet")
    paths["curation"] = write_table(counts, CURATION, out / "curation.parquet")
    return {"paths": paths, "counts": counts}


def apply_consensus(run_dir: Path, attempts: Rollouts, m: int) -> tuple[list[Problem], list[dict]]:
    """The consensus filter: keep the problems whose label the policy reached at least m times in
    `attempts` (scored). Adds its row to data/curation.parquet and its rejections to
    data/rejected.parquet; returns the kept problems and the updated per-filter counts."""
    solved = solved_attempts([t.problem_id for t in attempts.trajectories], attempts.rewards)
    problems = attempts.problems
    n = len(attempts.trajectories) // max(len(problems), 1)
    kept = [p for p in problems if solved.get(p.problem_id, 0) >= m]
    out = run_dir / "data"
    counts = read_table(out / "curation.parquet")
    counts.append({"filter": "consensus", "in": len(problems), "removed": len(problems) - len(kept), "kept": len(kept)})
    rejected = read_table(out / "rejected.parquet") + [
        {
            "row_id": p.problem_id,
            "source": p.kind,
            "stage": "consensus",
            "reason": f"label reached {solved.get(p.problem_id, 0)} of {n} times (< {m})",
        }
        for p in problems
        if solved.get(p.problem_id, 0) < m
    ]
    write_table(rejected, REJECTED, out / "rejected.parquet")
    write_table(counts, CURATION, out / "curation.parquet")
    if not kept:
        raise ValueError(
            f"the consensus filter kept no problem (none solved {m} of {n} times); lower "
            "data.consensus.m or leave the filter off until the policy can solve some"
        )
    return kept, counts


def load_problems(path: Path) -> list[Problem]:
    return [Problem(**row) for row in read_table(path)]


def select_problems(problems: list[Problem], ids: list[str]) -> list[Problem]:
    """The problems with these ids, in their original order (a filter's recorded choice)."""
    keep = set(ids)
    return [p for p in problems if p.problem_id in keep]
