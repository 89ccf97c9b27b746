"""Generated integer-answer math problems: the embedded default data set.

Each kind of problem comes with the Python program that solves it. The numbers are chosen so
that a small model cannot do the arithmetic in its head but can copy them into a program, so a
policy that learns to call the tool gains reward. Levels grow the size of the numbers and the
number of steps.

Five kinds have a natural first program that fails on their larger numbers, as real programs do:
the digit sum of a power or of a product of powers, and the last digit of a power or of a product
of powers and the first digit of a power, need `str()` of an integer past Python's 4,300-digit
limit on int-to-str conversion, which raises `ValueError` unless the program lifts it first
(`DIGIT_LIMIT_OFF`). Their solutions lift it; pre-training can show the program without it
(`unguarded`), so a policy's first call can fail and its second recover: the positives with tool
errors that RoC filters. A last or first digit is one of ten, and the last hangs on the exponent's
last two digits only: a second call that miscopies the rest still answers right, as a real model's
imperfect fix often does.

A second failure of that sort, in `recurrence`: half its solutions are the recursion as the
problem states it, which past Python's recursion limit of 1,000 frames raises `RecursionError`
unless the program raises the limit first (`RECURSION_LIMIT_OFF`); the other half are a loop,
which never fails.
"""

from __future__ import annotations

import hashlib
import math
import random
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager

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


DIGIT_LIMIT_OFF = "import sys\nsys.set_int_max_str_digits(0)\n"

# Exponents whose powers pass the 4,300-digit limit from level 2 on: level 1's stay under it
# (9^1500 has 1,432 digits; 9^700 * 9^700, 1,336).
_POWER_EXPONENTS = {1: (50, 1500), 2: (2_000, 9_000), 3: (9_000, 30_000)}
_PRODUCT_EXPONENTS = {1: (20, 700), 2: (1_000, 5_000), 3: (5_000, 15_000)}


RECURSION_LIMIT_OFF = "import sys\nsys.setrecursionlimit(100000)\n"
GUARDS = (DIGIT_LIMIT_OFF, RECURSION_LIMIT_OFF)

# Level 1's recursions stay under the 1,000 frames a program has; the others pass them.
_RECURSION_DEPTHS = {1: (100, 900), 2: (1_500, 6_000), 3: (6_000, 20_000)}


def _recurrence(rng: random.Random, level: int) -> tuple[str, str]:
    b, m = rng.randint(2, 9), rng.randint(101, 10 ** (level + 2))
    n = rng.randint(*_RECURSION_DEPTHS[min(level, max(_RECURSION_DEPTHS))])
    question = f"Let a(0) = 0 and a(n) = ({b} * a(n - 1) + n) mod {m} for n >= 1. What is a({n})?"
    if rng.random() < 0.5:
        return question, f"x = 0\nfor k in range(1, {n} + 1):\n    x = ({b} * x + k) % {m}\nprint(x)"
    recursion = f"def a(n):\n    return 0 if n == 0 else ({b} * a(n - 1) + n) % {m}\nprint(a({n}))"
    return question, RECURSION_LIMIT_OFF + recursion


def _exponent(ranges: dict[int, tuple[int, int]], rng: random.Random, level: int) -> int:
    return rng.randint(*ranges[min(level, max(ranges))])


def _digit_sum(rng: random.Random, level: int) -> tuple[str, str]:
    base, exp = rng.randint(2, 9), _exponent(_POWER_EXPONENTS, rng, level)
    return (
        f"What is the sum of the digits of {base}^{exp}?",
        f"{DIGIT_LIMIT_OFF}print(sum(int(d) for d in str({base}**{exp})))",
    )


def _digit_sum_of_product(rng: random.Random, level: int) -> tuple[str, str]:
    a, b = rng.sample(range(2, 10), 2)
    m, n = _exponent(_PRODUCT_EXPONENTS, rng, level), _exponent(_PRODUCT_EXPONENTS, rng, level)
    return (
        f"What is the sum of the digits of {a}^{m} * {b}^{n}?",
        f"{DIGIT_LIMIT_OFF}print(sum(int(d) for d in str({a}**{m} * {b}**{n})))",
    )


def _past_limit(base: int, level: int, share: float = 1.0) -> tuple[int, int]:
    """Exponents of `base` whose powers have `share` times 4,300 * level to 4,300 * (level + 1)
    digits: past the limit at every level, so the unguarded program always fails."""
    least = math.floor(4_300 / math.log10(base)) + 1
    return math.ceil(share * least * level), math.ceil(share * least * (level + 1))


def _digit_of_power(rng: random.Random, level: int, which: str, index: int) -> tuple[str, str]:
    base = rng.randint(2, 9)
    exp = rng.randint(*_past_limit(base, level))
    return (
        f"What is the {which} digit of {base}^{exp}?",
        f"{DIGIT_LIMIT_OFF}print(str({base}**{exp})[{index}])",
    )


def _last_digit(rng: random.Random, level: int) -> tuple[str, str]:
    return _digit_of_power(rng, level, "last", -1)


def _first_digit(rng: random.Random, level: int) -> tuple[str, str]:
    return _digit_of_power(rng, level, "first", 0)


def _last_digit_of_product(rng: random.Random, level: int) -> tuple[str, str]:
    a, b = rng.sample(range(2, 10), 2)
    m, n = rng.randint(*_past_limit(a, level, 0.5)), rng.randint(*_past_limit(b, level, 0.5))
    return (
        f"What is the last digit of {a}^{m} * {b}^{n}?",
        f"{DIGIT_LIMIT_OFF}print(str({a}**{m} * {b}**{n})[-1])",
    )


@contextmanager
def own_limits(digits_lifted: bool) -> Iterator[None]:
    """Inside: Python's digit limit on int <-> str conversion lifted, or as it is; after: this
    process's digit and recursion limits back, whatever the code inside set (a generated program
    may lift either)."""
    digits, frames = sys.get_int_max_str_digits(), sys.getrecursionlimit()
    if digits_lifted:
        sys.set_int_max_str_digits(0)
    try:
        yield
    finally:
        sys.set_int_max_str_digits(digits)
        sys.setrecursionlimit(frames)


def guard_of(code: str) -> str | None:
    """The limit-lifting lines the program starts with, if any."""
    return next((guard for guard in GUARDS if code.startswith(guard)), None)


def unguarded(code: str) -> str:
    """The program as most people first write it: without lifting the limit it passes."""
    guard = guard_of(code)
    return code.removeprefix(guard) if guard else code


KINDS: dict[str, Callable[[random.Random, int], tuple[str, str]]] = {
    "arithmetic": _arithmetic,
    "multistep": _multistep,
    "modular": _modular,
    "counting": _counting,
    "combinations": _combinations,
    "sum_of_powers": _sum_of_powers,
    "digit_sum": _digit_sum,
    "digit_sum_of_product": _digit_sum_of_product,
    "last_digit": _last_digit,
    "first_digit": _first_digit,
    "last_digit_of_product": _last_digit_of_product,
    "recurrence": _recurrence,
}


def solve(kind: str, question: str, code: str) -> str:
    """The answer, computed by running the solution program (generated, trusted code)."""
    printed: list[str] = []
    with own_limits(digits_lifted=False):
        exec(code, {"print": lambda value: printed.append(str(value)), "math": math})  # noqa: S102
    if len(printed) != 1 or not printed[0].lstrip("-").isdigit():
        raise ValueError(f"{kind} problem {question!r}: solution printed {printed!r}, not one integer")
    return printed[0]


def problem_id(question: str) -> str:
    return hashlib.sha1(question.encode()).hexdigest()[:12]


def problem_statements(
    n: int, levels: list[int], seed: int, kinds: list[str] | None = None
) -> Iterator[tuple[str, int, str, str]]:
    """n distinct (kind, level, question, solution code), kinds (None: every one of KINDS) and
    levels drawn uniformly, deterministic from the seed; unsolved, for uses that need no answer
    (solving the counting and sum problems is a Python loop of up to 10^5 steps)."""
    if not levels or any(level < 1 for level in levels):
        raise ValueError(f"levels must be a non-empty list of positive integers, got {levels}")
    if kinds is not None and (not kinds or set(kinds) - set(KINDS)):
        raise ValueError(f"data.kinds {kinds}: each must be one of {sorted(KINDS)}")
    names = sorted(KINDS if kinds is None else set(kinds))
    rng = random.Random(seed)
    seen: set[str] = set()
    attempts = 0
    while len(seen) < n:
        attempts += 1
        if attempts > 20 * n + 100:
            raise ValueError(f"could not generate {n} distinct problems at levels {levels}")
        kind = rng.choice(names)
        level = rng.choice(levels)
        question, code = KINDS[kind](rng, level)
        if question not in seen:
            seen.add(question)
            yield kind, level, question, code


def generate_problems(n: int, levels: list[int], seed: int, kinds: list[str] | None = None) -> list[Problem]:
    """n distinct problems with their answers (see `problem_statements`)."""
    return [
        Problem(problem_id(question), kind, level, question, solve(kind, question, code), code)
        for kind, level, question, code in problem_statements(n, levels, seed, kinds)
    ]


def split_problems(problems: list[Problem], n_heldout: int, seed: int) -> tuple[list[Problem], list[Problem]]:
    """(train, held-out): a seeded shuffle, so held-out problems are never trained on."""
    order = sorted(problems, key=lambda p: p.problem_id)
    random.Random(seed).shuffle(order)
    return order[n_heldout:], order[:n_heldout]
