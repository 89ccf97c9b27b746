"""Curation: filters as pure functions, and the curate flow over small files written in the exact
column layouts of the public data sets (DAPO-Math-17k, OpenMathReasoning, a Project Euler JSONL
export, AIME 2024 saved with `datasets.save_to_disk`), checking every filter's count."""

import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from tasks.config import DataConfig, SourceConfig
from tasks.data.filters import decontaminate, exact_duplicates, near_duplicates, parse_integer
from tasks.data.sources import RawProblem, SourceError, load_source
from tasks.store.tables import read_table

AIME_PROBLEM = (
    "Every morning Aya goes for a 9-kilometer-long walk and stops at a coffee shop afterwards. "
    "When she walks at a constant speed of s kilometers per hour, the walk takes her 4 hours."
)


def raw(row_id: str, question: str, answer: str = "1") -> RawProblem:
    return RawProblem(row_id, "t", question, answer)


@pytest.mark.parametrize(
    "text, value",
    [
        ("42", 42),
        (" -7 ", -7),
        ("$12$", 12),
        ("\\boxed{1,024}", 1024),
        ("12.0", 12),
        ("+3", 3),
        ("1,234,567", 1234567),
        ("3.5", None),
        ("\\frac{1}{2}", None),
        ("x = 4", None),
        ("", None),
        ("1,23", None),
    ],
)
def test_parse_integer(text, value) -> None:
    assert parse_integer(text) == value


def test_exact_duplicates_ignore_case_spacing_and_punctuation() -> None:
    kept, rejected = exact_duplicates([raw("a", "Find x: 2x = 4."), raw("b", "find  X 2x = 4"), raw("c", "Find y.")])
    assert [r.row_id for r in kept] == ["a", "c"]
    assert rejected[0].row_id == "b" and "same text as a" in rejected[0].reason


def test_near_duplicates_need_the_same_numbers() -> None:
    base = "A train leaves the station at 3 pm travelling at 60 miles per hour toward a city 240 miles away."
    reworded = base.replace("toward", "towards").replace("travelling", "traveling")
    other_numbers = base.replace("240", "300")
    kept, rejected = near_duplicates([raw("a", base), raw("b", reworded), raw("c", other_numbers)], threshold=0.8)
    assert [r.row_id for r in kept] == ["a", "c"]
    assert [r.row_id for r in rejected] == ["b"] and "similar to a" in rejected[0].reason


def test_decontamination_on_shared_8_grams() -> None:
    evaluation = [raw("aime:1", AIME_PROBLEM)]
    leaked = "Solve this. " + " ".join(AIME_PROBLEM.split()[3:12]) + " and more."
    kept, rejected = decontaminate(
        [raw("x", leaked), raw("y", "Compute 2 + 2 for the coffee shop walk.")], evaluation, 8
    )
    assert [r.row_id for r in kept] == ["y"] and rejected[0].reason == "shares a 8-gram with aime:1"


# ---------------------------------------------------------------------------------------------
# Files in the public data sets' layouts


def write_dapo(path: Path) -> None:
    """DAPO-Math-17k: the problem is the first chat message, the label in reward_model."""

    def row(i: int, question: str, answer: str) -> dict:
        return {
            "data_source": "math_dapo",
            "prompt": [{"content": question, "role": "user"}],
            "ability": "MATH",
            "reward_model": {"ground_truth": answer, "style": "rule-lighteval/MATH_v2"},
            "extra_info": {"index": f"dapo-{i}", "split": "default"},
        }

    rows = [
        row(0, "What is 17 * 23?", "391"),
        row(1, "How many primes are below 100?", "25"),
        row(2, "Solve this. " + " ".join(AIME_PROBLEM.split()[:10]) + ", then add 1.", "5"),  # contaminated
        row(3, "What is 2 to the power 50?", "1125899906842624"),  # 16 digits: huge
        row(4, "Compute the sum of the first 10 positive integers.", "55"),
    ]
    pq.write_table(pa.Table.from_pylist(rows), path)


def write_open_math_reasoning(path: Path) -> None:
    rows = [
        {"problem": "What is 17 * 23?", "expected_answer": "391"},  # exact duplicate of dapo-0
        {"problem": "Find the remainder when 2^10 is divided by 7.", "expected_answer": "2"},
        {"problem": "Find the remainder when 2^10 is divided by 7!", "expected_answer": "2"},  # duplicate
        {"problem": "What is one half of one?", "expected_answer": "\\frac{1}{2}"},  # not an integer
        {"problem": "What is 6 * 7?", "expected_answer": None},  # missing answer
        {"problem": "   ", "expected_answer": "4"},  # empty problem
        {"problem": "Compute the sum of the first 10 positive integers, please.", "expected_answer": "55"},  # near
    ]
    for r in rows:
        r.update(
            generated_solution="...",
            generation_model="DeepSeek-R1",
            problem_type="has_answer_extracted",
            problem_source="aops_c4",
            inference_mode="tir",
            pass_rate_72b_tir="0.5",
        )
    pq.write_table(pa.Table.from_pylist(rows), path)


def write_euler(path: Path) -> None:
    rows = [
        {"id": 1, "problem": "Find the sum of all the multiples of 3 or 5 below 1000.", "answer": "233168"},
        {"id": 2, "problem": 12345, "answer": "1"},  # wrong type
        {"id": 3, "problem": "Find the largest prime factor of 600851475143.", "answer": 6857},
    ]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def write_aime_saved_to_disk(directory: Path) -> None:
    """Maxwell-Jia/AIME_2024 after `save_to_disk`: an Arrow stream file listed in state.json."""
    directory.mkdir()
    table = pa.Table.from_pylist([{"ID": "2024-I-1", "Problem": AIME_PROBLEM, "Solution": "...", "Answer": 204}])
    with (
        pa.OSFile(str(directory / "data-00000-of-00001.arrow"), "wb") as sink,
        pa.ipc.new_stream(sink, table.schema) as writer,
    ):
        writer.write_table(table)
    (directory / "state.json").write_text(
        json.dumps({"_data_files": [{"filename": "data-00000-of-00001.arrow"}], "_split": "train"})
    )
    (directory / "dataset_info.json").write_text(json.dumps({"features": {}}))


@pytest.fixture()
def files(tmp_path: Path) -> dict[str, Path]:
    paths = {
        "dapo": tmp_path / "dapo.parquet",
        "omr": tmp_path / "omr.parquet",
        "euler": tmp_path / "euler.jsonl",
        "aime": tmp_path / "aime_2024",
    }
    write_dapo(paths["dapo"])
    write_open_math_reasoning(paths["omr"])
    write_euler(paths["euler"])
    write_aime_saved_to_disk(paths["aime"])
    return paths


def data_config(files: dict[str, Path]) -> DataConfig:
    return DataConfig(
        n_heldout=2,
        malformed_rows="skip",  # the files hold malformed rows on purpose: curation counts them
        sources=[
            SourceConfig(
                name="dapo",
                format="parquet",
                path=str(files["dapo"]),
                problem="prompt.0.content",
                answer="reward_model.ground_truth",
                id="extra_info.index",
            ),
            SourceConfig(name="omr", format="parquet", path=str(files["omr"]), answer="expected_answer"),
            SourceConfig(name="euler", format="jsonl", path=str(files["euler"]), id="id"),
        ],
        benchmarks=[
            SourceConfig(
                name="aime24", format="hf_disk", path=str(files["aime"]), problem="Problem", answer="Answer", id="ID"
            )
        ],
    )


def run_context(tmp_path: Path):
    from tasks.records import RunContext
    from tasks.tracking.mlflow_log import Tracker

    out = tmp_path / "outputs"
    tracker = Tracker(out)
    return RunContext("curation-test", out / "runs" / "curation-test", tracker.start_run("curation-test", {}), out)


def test_curate_flow_counts_every_filter(files, tmp_path, prefect_api) -> None:
    from flows.curate import curate
    from tasks.tracking.mlflow_log import Tracker

    ctx = run_context(tmp_path)
    tracker = Tracker(ctx.output_dir)
    paths = curate(data_config(files), ctx)

    counts = {row["filter"]: row["removed"] for row in read_table(paths["curation"])}
    assert counts == {
        "malformed": 3,
        "integer": 1,
        "huge_answer": 1,
        "exact_duplicate": 2,
        "near_duplicate": 1,
        "decontamination": 1,
    }
    rejected = {row["row_id"]: (row["stage"], row["reason"]) for row in read_table(paths["rejected"])}
    assert rejected["omr:4"] == ("malformed", "missing answer (expected_answer)")
    assert rejected["omr:5"] == ("malformed", "empty problem (problem)")
    assert rejected["euler:2"] == ("malformed", "problem (problem) is int, not text")
    assert rejected["omr:3"][0] == "integer"
    assert rejected["dapo:dapo-3"][0] == "huge_answer"
    assert rejected["omr:0"] == ("exact_duplicate", "same text as dapo:dapo-0")
    assert rejected["dapo:dapo-2"] == ("decontamination", "shares a 8-gram with aime24:2024-I-1")
    train, heldout = read_table(paths["train"]), read_table(paths["heldout"])
    assert len(train) + len(heldout) == 6 and len(heldout) == 2
    euler = {r["problem_id"]: r["answer"] for r in train + heldout if r["problem_id"].startswith("euler")}
    assert euler == {"euler:1": "233168", "euler:3": "6857"}  # an int label becomes its text
    metrics = tracker.client.get_run(ctx.mlflow_run_id).data.metrics
    assert metrics["curation/exact_duplicate_removed"] == 2 and metrics["curation/kept"] == 6


def test_missing_column_names_the_file_and_column(files, tmp_path) -> None:
    with pytest.raises(SourceError, match=r"omr\.parquet: no column 'answer' \(needed for 'answer'\)"):
        load_source("omr", "parquet", files["omr"], "problem", "answer")
    with pytest.raises(SourceError, match=r"euler\.jsonl: no row has the key 'solution'"):
        load_source("euler", "jsonl", files["euler"], "problem", "solution")


def test_a_malformed_row_is_an_error_naming_the_file_row_and_column(files) -> None:
    with pytest.raises(SourceError) as exc:
        load_source("omr", "parquet", files["omr"], "problem", "expected_answer")
    # Under the default (data.malformed_rows: error); row 4 is the first without its answer.
    assert str(exc.value).startswith(f"{files['omr']}, row 4: missing answer (expected_answer); ")
    with pytest.raises(SourceError, match=r"euler\.jsonl, row 1 \(id 2\): problem \(problem\) is int, not text"):
        load_source("euler", "jsonl", files["euler"], "problem", "answer", "id")
    rows, rejected = load_source("omr", "parquet", files["omr"], "problem", "expected_answer", malformed="skip")
    assert len(rows) == 5 and [r.row_id for r in rejected] == ["omr:4", "omr:5"]


def test_unreadable_file_is_named_and_nothing_is_written(files, tmp_path) -> None:
    from tasks.data.problem_sets import curate

    broken = tmp_path / "broken.parquet"
    broken.write_bytes(b"not a parquet file at all")
    data = data_config(files).model_copy(
        update={"sources": [SourceConfig(name="b", format="parquet", path=str(broken))]}
    )
    run_dir = tmp_path / "run"
    with pytest.raises(SourceError, match=r"broken\.parquet: cannot read as parquet"):
        curate(data, run_dir)
    assert not (run_dir / "data").exists()


def test_consensus_filter_keeps_labels_the_policy_reaches_m_times(files, tmp_path) -> None:
    from tasks.data.problem_sets import apply_consensus, curate, load_problems
    from tasks.records import Rollouts, RolloutTimes, Trajectory

    run_dir = tmp_path / "run"
    paths = curate(data_config(files), run_dir)["paths"]
    train = load_problems(paths["train"])
    # 3 attempts per problem; problem i solved i times (capped at 3).
    trajectories = [Trajectory(p.problem_id, s, [1]) for p in train for s in range(3)]
    rollouts = Rollouts(train, trajectories, RolloutTimes())
    rollouts.rewards = [float(s < i) for i, _ in enumerate(train) for s in range(3)]
    kept, _ = apply_consensus(run_dir, rollouts, m=2)
    assert [p.problem_id for p in kept] == [p.problem_id for p in train[2:]]
    counts = read_table(paths["curation"])
    assert counts[-1] == {"filter": "consensus", "in": 4, "removed": 2, "kept": 2}
    reasons = {r["row_id"]: r["reason"] for r in read_table(paths["rejected"]) if r["stage"] == "consensus"}
    assert reasons == {
        train[0].problem_id: "label reached 0 of 3 times (< 2)",
        train[1].problem_id: "label reached 1 of 3 times (< 2)",
    }
