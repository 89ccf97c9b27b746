"""Outcome reward: extract the final answer of a rollout and check it against the label.

reward = 1.0 if is_correct(extract_answer(response), label) else 0.0

- extract_answer: the content of the last \\boxed{...} inside the last <answer>...</answer> block.
- is_correct: an exact integer comparison when both sides are integers (training labels always
  are), otherwise math-verify with the gold answer first: verify(parse(gold), parse(pred)).
- Verifier: math-verify's own timeouts use signal.alarm, which only works on the main thread of
  a process, and Prefect runs tasks on worker threads. Verifier therefore runs the math-verify
  path in a one-process pool (spawned, so no inherited threads or locks), with an outer
  per-call timeout on top; a call that times out or crashes scores 0 and the worker is replaced.

Nothing here raises on bad model output: garbage, empty, huge or unbalanced responses score 0.
"""

import concurrent.futures
import multiprocessing
import re
import threading
from concurrent.futures.process import BrokenProcessPool

from tasks.records import Rollouts

ANSWER_OPEN = "<answer>"
ANSWER_CLOSE = "</answer>"
# Answers longer than this are not sent to sympy: parsing a huge expression can take minutes,
# and no real label is this long (training labels are integers).
MAX_ANSWER_CHARS = 1000

_BOXED = re.compile(r"\\boxed\s*\{")
_INTEGER = re.compile(r"([+-]?)([0-9]*)(?:\.([0-9]*))?")
# LaTeX spacing and digit-group separators that may sit inside a number: \! \, \; \: "\ " {,} ,
_NUMBER_NOISE = re.compile(r"\\[!,;: ]|\{,\}|,|\s+")


# ------------------------------------------------------------------------------------------------
# Extraction


def _answer_blocks(response: str) -> list[tuple[int, int]]:
    """(start, end) of the content of each complete <answer>...</answer> block, left to right.

    A block runs from an opening tag to the next closing tag, like the regex
    <answer>(.*?)</answer> but linear-time on any input (the regex is quadratic on a string
    full of unclosed opening tags). An unclosed trailing <answer> is not a block.
    """
    blocks = []
    position = 0
    while True:
        start = response.find(ANSWER_OPEN, position)
        if start < 0:
            return blocks
        start += len(ANSWER_OPEN)
        end = response.find(ANSWER_CLOSE, start)
        if end < 0:
            return blocks
        blocks.append((start, end))
        position = end + len(ANSWER_CLOSE)


def count_answer_blocks(response: str) -> int:
    """Number of complete <answer>...</answer> blocks (what p_format counts)."""
    return len(_answer_blocks(response))


def _braced_content(text: str, open_brace: int) -> str | None:
    """Content between text[open_brace] == '{' and its matching '}', or None if unbalanced.

    A backslash escapes the next character, so \\{ and \\} (literal braces in LaTeX) do not count.
    """
    depth = 0
    i = open_brace
    while i < len(text):
        char = text[i]
        if char == "\\":
            i += 2
            continue
        if char == "{":
            depth += 1
        elif char == "}":
            depth -= 1
            if depth == 0:
                return text[open_brace + 1 : i]
        i += 1
    return None


def extract_answer(response: str) -> str | None:
    """Content of the LAST \\boxed{...} inside the LAST <answer>...</answer> block, stripped.

    None when there is no complete answer block, no \\boxed{ in it, or the last \\boxed{ has no
    matching closing brace. A \\boxed outside the answer block is ignored: the format asks for
    the final answer inside the block, and earlier boxes are often intermediate results.
    """
    if not isinstance(response, str):
        return None
    blocks = _answer_blocks(response)
    if not blocks:
        return None
    start, end = blocks[-1]
    block = response[start:end]
    boxed = list(_BOXED.finditer(block))
    if not boxed:
        return None
    last = boxed[-1]
    content = _braced_content(block, last.end() - 1)
    return None if content is None else content.strip()


# ------------------------------------------------------------------------------------------------
# Checking


def canonical_integer(text: str) -> str | None:
    """Canonical decimal string of an integer written in `text`, or None if it is not one.

    Drops LaTeX spacing (\\! \\, \\; \\: "\\ "), digit-group commas ({,} and ,), whitespace and a
    leading +; "042" -> "42", "-0" -> "0", "3.0" -> "3" (a decimal counts only if its
    fractional part is all zeros), "3.5" -> None. Works on strings rather than int() so there is
    no size limit and no float rounding.
    """
    cleaned = _NUMBER_NOISE.sub("", text)
    match = _INTEGER.fullmatch(cleaned)
    if match is None:
        return None
    sign, whole, fraction = match.groups()
    if not whole and not fraction:
        return None  # "", "+", "." ...
    if fraction and fraction.strip("0"):
        return None
    whole = whole.lstrip("0") or "0"
    return "-" + whole if sign == "-" and whole != "0" else whole


def _parse_for_math_verify(text: str) -> list:
    """math-verify parse of a bare answer: wrapped in \\boxed{} first, then $...$ as a fallback."""
    from math_verify import parse  # heavy (sympy): imported only where the slow path runs

    for wrapped in (f"\\boxed{{{text}}}", f"${text}$"):
        parsed = parse(wrapped)
        if parsed:
            return parsed
    return []


def math_verify_equal(pred: str, label: str) -> bool:
    """math-verify, gold first: verify(parse(label), parse(pred)); False on any error.

    Uses math-verify's signal.alarm timeouts, so call it on a main thread (Verifier does this in
    its worker process).
    """
    from math_verify import verify

    try:
        gold = _parse_for_math_verify(label)
        answer = _parse_for_math_verify(pred)
        return bool(gold and answer and verify(gold, answer))
    except Exception:  # noqa: BLE001 - any failure of the checker means "not verified"
        return False


def integer_fast_path(pred: str | None, label: str) -> bool | None:
    """True/False when the answer is decided without math-verify, None when it is needed.

    Decided: no prediction, an empty or over-long one (False), or both sides integers (exact
    comparison). Training labels are integers, so almost every RL rollout stops here.
    """
    if pred is None:
        return False
    pred = pred.strip()
    if not pred or len(pred) > MAX_ANSWER_CHARS:
        return False
    pred_integer, label_integer = canonical_integer(pred), canonical_integer(label)
    if pred_integer is not None and label_integer is not None:
        return pred_integer == label_integer
    return None


def is_correct(pred: str | None, label: str) -> bool:
    """Is the extracted answer `pred` equal to `label`?

    Integer fast path first (see integer_fast_path), else math_verify_equal(pred, label).
    Runs math-verify inline: call it only on a main thread; use Verifier elsewhere.
    """
    label = str(label)
    decided = integer_fast_path(pred, label)
    if decided is not None:
        return decided
    return math_verify_equal(pred.strip(), label.strip())


def _warm_up() -> bool:
    """Import math-verify and sympy in the worker, so the first real call is not timed out."""
    return math_verify_equal("\\frac{1}{2}", "0.5")


class Verifier:
    """Scores responses against labels, thread-safe, with math-verify in a worker process.

    Verifier(timeout_s) -> .score(responses, labels) -> [1.0 / 0.0]; close() or use `with`.
    The integer fast path runs inline; only non-integer answers go to the worker, one call at
    a time under a lock. A call that does not finish within timeout_s (math-verify's own
    timeouts are 5 s per parse / comparison; this is a backstop for a stuck sympy) or crashes
    the worker scores 0; the worker is killed and a fresh one started on the next call.
    """

    def __init__(self, timeout_s: float = 20.0, startup_timeout_s: float = 120.0):
        self.timeout_s = timeout_s
        self.startup_timeout_s = startup_timeout_s  # spawning + importing sympy is slow
        self._pool: concurrent.futures.ProcessPoolExecutor | None = None
        self._lock = threading.Lock()

    # -- worker lifecycle

    def _start_pool(self) -> concurrent.futures.ProcessPoolExecutor:
        # spawn: a fork of a multi-threaded parent (Prefect, torch) can inherit held locks
        pool = concurrent.futures.ProcessPoolExecutor(max_workers=1, mp_context=multiprocessing.get_context("spawn"))
        try:
            pool.submit(_warm_up).result(timeout=self.startup_timeout_s)
        except BaseException:
            self._kill(pool)
            raise
        return pool

    @staticmethod
    def _kill(pool: concurrent.futures.ProcessPoolExecutor) -> None:
        # shutdown() alone would wait for (or leave running) a worker stuck in sympy
        for process in list((getattr(pool, "_processes", None) or {}).values()):
            try:
                process.kill()
            except Exception:  # noqa: BLE001 - already gone
                pass
        pool.shutdown(wait=False, cancel_futures=True)

    def _in_worker(self, pred: str, label: str) -> bool:
        """math_verify_equal(pred, label) in the worker; False on timeout, crash or start failure."""
        with self._lock:
            try:
                if self._pool is None:
                    self._pool = self._start_pool()
                future = self._pool.submit(math_verify_equal, pred, label)
                return bool(future.result(timeout=self.timeout_s))
            except (concurrent.futures.TimeoutError, BrokenProcessPool):
                if self._pool is not None:
                    self._kill(self._pool)
                self._pool = None
                return False
            except Exception:  # noqa: BLE001 - e.g. spawn failed; score 0 rather than crash RL
                return False

    # -- public API

    def check(self, pred: str | None, label: str) -> bool:
        """is_correct(pred, label) with the math-verify path in the worker."""
        try:
            label = str(label)
            decided = integer_fast_path(pred, label)
            if decided is not None:
                return decided
            return self._in_worker(pred.strip(), label.strip())
        except Exception:  # noqa: BLE001 - never let one bad answer stop a batch
            return False

    def score(self, responses: list[str], labels: list[str]) -> list[float]:
        """1.0 if is_correct(extract_answer(response), label) else 0.0, per response."""
        if len(responses) != len(labels):
            raise ValueError(f"{len(responses)} responses but {len(labels)} labels")
        rewards = []
        for response, label in zip(responses, labels):
            try:
                correct = self.check(extract_answer(response), label)
            except Exception:  # noqa: BLE001
                correct = False
            rewards.append(1.0 if correct else 0.0)
        return rewards

    def close(self) -> None:
        """Stop the worker process (a later call starts a new one)."""
        with self._lock:
            if self._pool is not None:
                # no call is in flight while we hold the lock, so a clean shutdown cannot hang
                self._pool.shutdown(wait=True, cancel_futures=True)
                self._pool = None

    def __enter__(self) -> "Verifier":
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:  # noqa: BLE001 - interpreter shutdown
            pass


def score_rollouts(verifier: Verifier, rollouts: Rollouts) -> Rollouts:
    """Set each trajectory's outcome reward, predicted answer and count of <answer> blocks (RoC
    penalises more than one) on the rollouts, which are returned."""
    labels = {p.problem_id: p.answer for p in rollouts.problems}
    responses = [t.response for t in rollouts.trajectories]
    rollouts.rewards = verifier.score(responses, [labels[t.problem_id] for t in rollouts.trajectories])
    rollouts.predicted = [extract_answer(r) for r in responses]
    rollouts.answer_blocks = [count_answer_blocks(r) for r in responses]
    return rollouts
