"""Outcome reward (tasks/reward/verify.py): answer extraction, integer fast path, math-verify worker.

Covers extract_answer (nested and escaped braces, several answer blocks, \\boxed outside the
answer block ignored, missing or unclosed pieces), count_answer_blocks, the inline integer fast
path, a non-integer answer checked by math-verify inside the Verifier's worker process (also
from a non-main thread), the timeout path, and that garbage responses score 0 without raising.
The Verifier tests spawn a worker that imports sympy: a few seconds.

Run: OMP_NUM_THREADS=1 python -m pytest tests/test_reward.py -q
"""

import concurrent.futures
import random
import time

import pytest

from tasks.reward.verify import (
    Verifier,
    canonical_integer,
    count_answer_blocks,
    extract_answer,
    integer_fast_path,
    is_correct,
)


@pytest.fixture(scope="module")
def verifier():
    with Verifier() as v:
        yield v


# ------------------------------------------------------------------------------------------------
# Extraction


@pytest.mark.parametrize(
    "response,expected",
    [
        ("reasoning <answer>so \\boxed{42}.</answer>", "42"),
        ("<answer>\\boxed{\\frac{\\sqrt{3}}{2}}</answer>", "\\frac{\\sqrt{3}}{2}"),  # nested braces
        ("<answer>\\boxed{\\{1, 2\\}}</answer>", "\\{1, 2\\}"),  # escaped braces do not count
        ("<answer>\\boxed {7}</answer>", "7"),  # space before the brace
        ("<answer>\\boxed{1} or \\boxed{2}</answer>", "2"),  # last box in the block
        ("<answer>\\boxed{1}</answer> more <answer>\\boxed{3}</answer>", "3"),  # last block
        ("\\boxed{5} <answer>\\boxed{7}</answer> \\boxed{9}", "7"),  # boxes outside are ignored
        ("<answer>\\boxed{1}</answer> <answer>no box</answer>", None),  # last block has no box
        ("<answer>no box</answer> \\boxed{3}", None),
        ("no answer block \\boxed{3}", None),
        ("<answer>\\boxed{3}", None),  # unclosed block (truncated rollout)
        ("<answer>\\boxed{3} and \\boxed{4</answer>", None),  # last box unbalanced
        ("<answer>\\boxed{}</answer>", ""),
        ("", None),
    ],
)
def test_extract_answer(response, expected):
    assert extract_answer(response) == expected


def test_count_answer_blocks():
    assert count_answer_blocks("no blocks") == 0
    assert count_answer_blocks("<answer>a</answer>") == 1
    assert count_answer_blocks("<answer>a</answer> x <answer>b</answer>") == 2
    assert count_answer_blocks("<answer>a</answer> <answer>unclosed") == 1
    assert count_answer_blocks("<answer>" * 100_000) == 0  # linear time, no regex blow-up


# ------------------------------------------------------------------------------------------------
# Integer fast path (inline, no math-verify)


@pytest.mark.parametrize(
    "pred,label,expected",
    [
        ("42", "42", True),
        ("042", "42", True),
        (" +42 ", "42", True),
        ("42.0", "42", True),
        ("42.", "42", True),
        ("1,000", "1000", True),
        ("1{,}000", "1000", True),
        ("1\\!000", "1000", True),
        ("1\\,000", "1 000", True),
        ("-0", "0", True),
        ("-5", "-5", True),
        ("41", "42", False),
        ("-42", "42", False),
        ("42.5", "42", None),  # not an integer: math-verify decides
        ("\\frac{84}{2}", "42", None),
        (None, "42", False),
        ("", "42", False),
        ("   ", "42", False),
    ],
)
def test_integer_fast_path(pred, label, expected):
    assert integer_fast_path(pred, label) is expected


def test_canonical_integer():
    assert canonical_integer("0007") == "7"
    assert canonical_integer("3.000") == "3"
    assert canonical_integer("3.01") is None
    assert canonical_integer("1e3") is None
    assert canonical_integer("+") is None
    assert canonical_integer("9" * 10_000) == "9" * 10_000  # no int() digit limit


def test_is_correct_inline():
    assert is_correct("042", "42") is True
    assert is_correct("\\frac{84}{2}", "42") is True  # math-verify inline (main thread)
    assert is_correct("\\frac{1}{3}", "0.5") is False


# ------------------------------------------------------------------------------------------------
# Verifier: math-verify in a worker process


def test_non_integer_answer_goes_through_the_worker(verifier):
    assert verifier.check("\\frac{1}{2}", "0.5") is True
    assert verifier.check("\\frac{1}{3}", "0.5") is False
    responses = [
        "<answer>The probability is \\boxed{\\frac{1}{2}}.</answer>",
        "<answer>\\boxed{0.25}</answer>",
        "<answer>\\boxed{042}</answer>",
        "<answer>\\boxed{41}</answer>",
    ]
    assert verifier.score(responses, ["0.5", "0.5", "42", 42]) == [1.0, 0.0, 1.0, 0.0]


def test_verifier_works_off_the_main_thread(verifier):
    # math-verify's signal.alarm would fail here if it ran inline; the worker has its own main thread
    with concurrent.futures.ThreadPoolExecutor(max_workers=1) as threads:
        result = threads.submit(verifier.score, ["<answer>\\boxed{\\sqrt{4}}</answer>"], ["2"]).result()
    assert result == [1.0]


def test_timeout_scores_zero_and_the_worker_recovers(verifier):
    # 9^(9^9) has ~370 million digits: sympy evaluates it eagerly inside one C call, so the
    # worker is stuck far past the timeout (a tiny timeout instead raced a fast worker).
    verifier.timeout_s = 0.5
    try:
        started = time.monotonic()
        assert verifier.check("9^{9^{9}}", "7") is False
        assert time.monotonic() - started < 10
    finally:
        verifier.timeout_s = 20.0
    assert verifier.check("\\frac{13}{17}", "13/17") is True  # a fresh worker took over


def test_garbage_never_raises(verifier):
    rng = random.Random(0)
    noise = "".join(chr(rng.randrange(0, 0x3000)) for _ in range(5000))
    responses = [
        "",
        "}}}{{{",
        noise,
        "<answer>" + noise + "</answer>",
        "<answer>" * 50_000,
        "<answer>" + "\\boxed{" * 20_000 + "</answer>",
        "<answer>\\boxed{" + "x^" * 5_000 + "1}</answer>",  # huge: refused before sympy
        "<answer>\\boxed{\\frac{1}{</answer>",
        "<answer>\\boxed{)(*&^%$#@!}</answer>",
        "<answer>\\boxed{\\begin{matrix}</answer>",
        None,
    ]
    rewards = verifier.score(responses, ["42"] * len(responses))
    assert rewards == [0.0] * len(responses)
    with pytest.raises(ValueError):
        verifier.score(["a"], [])
