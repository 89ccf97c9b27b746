"""Generated integer-answer math problems: the embedded default data set.

Each kind of problem comes with the Python program that solves it. The numbers are chosen so
that a small model cannot do the arithmetic in its head but can copy them into a program, so a
policy that learns to call the tool gains reward. Levels grow the size of the numbers and the
number of steps.
"""

from __future__ import annotations

import hashlib
import math
import random
from collections.abc import Callable, Iterator

from tasks.records import Problem


def _digits(rng: random.Random, level: int) -> int:
    """A number with 1 + level digits (2 at level 1, 4 at level 3)."""
    return rng.randint(10**level, 10 ** (level + 1) - 1)


def _arithmetic(rng: random.Random, level: int) -> tuple[str, str]:
    a, b, c = _digits(rng, level), _digits(rng, level), _digits(rng, level)
    return f"Compute {a} * {b} + {c}.", f"print({a} * {b} + {c})"


def _multistep(rng: random.Random, level: int) -> tuple[str, str]:
    a, b, c, d = (_digits(rng, level) for _ in range(4))
    return (
        f"Compute ({a} + {b}) * {c} - {d}.",
        f"print(({a} + {b}) * {c} - {d})",
    )


def _modular(rng: random.Random, level: int) -> tuple[str, str]:
    base, exp, mod = rng.randint(2, 9 + 10 * level), rng.randint(5, 40 * level), 10 ** rng.randint(2, 2 + level)
    return (
        f"What is the remainder when {base}^{exp} is divided by {mod}?",
        f"print(pow({base}, {exp}, {mod}))",
    )


def _counting(rng: random.Random, level: int) -> tuple[str, str]:
    # The second divisor's leading digit varies: drawn from 10-19, every one began with the 1 that
    # fills the prompt, and the tiny model copied the wrong second digit.
    n, a, b = rng.randint(100, 10 ** (level + 2)), rng.randint(2, 9), rng.randint(11, 97)
    return (
        f"How many integers from 1 to {n} are divisible by {a} or {b}?",
        f"print(sum(1 for k in range(1, {n} + 1) if k % {a} == 0 or k % {b} == 0))",
    )


def _combinations(rng: random.Random, level: int) -> tuple[str, str]:
    n = rng.randint(8, 8 + 6 * level)
    k = rng.randint(2, n // 2)
    return (
        f"In how many ways can {k} items be chosen from {n} distinct items?",
        f"import math\nprint(math.comb({n}, {k}))",
    )


def _sum_of_powers(rng: random.Random, level: int) -> tuple[str, str]:
    n, p = rng.randint(10, 10 ** (level + 1)), rng.randint(1, 3)
    return (
        f"What is the sum of k^{p} for k from 1 to {n}?",
        f"print(sum(k**{p} for k in range(1, {n} + 1)))",
    )


KINDS: dict[str, Callable[[random.Random, int], tuple[str, str]]] = {
    "arithmetic": _arithmetic,
    "multistep": _multistep,
    "modular": _modular,
    "counting": _counting,
    "combinations": _combinations,
    "sum_of_powers": _sum_of_powers,
}


def solve(kind: str, question: str, code: str) -> str:
    """The answer, computed by running the solution program (generated, trusted code)."""
    printed: list[str] = []
    exec(code, {"print": lambda value: printed.append(str(value)), "math": math})  # noqa: S102
    if len(printed) != 1 or not printed[0].lstrip("-").isdigit():
        raise ValueError(f"{kind} problem {question!r}: solution printed {printed!r}, not one integer")
    return printed[0]


def problem_id(question: str) -> str:
    return hashlib.sha1(question.encode()).hexdigest()[:12]


def problem_statements(n: int, levels: list[int], seed: int) -> Iterator[tuple[str, int, str, str]]:
    """n distinct (kind, level, question, solution code), kinds and levels drawn uniformly,
    deterministic from the seed; unsolved, for uses that need no answer (solving the counting
    and sum problems is a Python loop of up to 10^5 steps)."""
    if not levels or any(level < 1 for level in levels):
        raise ValueError(f"levels must be a non-empty list of positive integers, got {levels}")
    rng = random.Random(seed)
    seen: set[str] = set()
    attempts = 0
    while len(seen) < n:
        attempts += 1
        if attempts > 20 * n + 100:
            raise ValueError(f"could not generate {n} distinct problems at levels {levels}")
        kind = rng.choice(sorted(KINDS))
        level = rng.choice(levels)
        question, code = KINDS[kind](rng, level)
        if question not in seen:
            seen.add(question)
            yield kind, level, question, code


def generate_problems(n: int, levels: list[int], seed: int) -> list[Problem]:
    """n distinct problems with their answers (see `problem_statements`)."""
    return [
        Problem(problem_id(question), kind, level, question, solve(kind, question, code), code)
        for kind, level, question, code in problem_statements(n, levels, seed)
    ]


def split_problems(problems: list[Problem], n_heldout: int, seed: int) -> tuple[list[Problem], list[Problem]]:
    """(train, held-out): a seeded shuffle, so held-out problems are never trained on."""
    order = sorted(problems, key=lambda p: p.problem_id)
    random.Random(seed).shuffle(order)
    return order[n_heldout:], order[:n_heldout]
