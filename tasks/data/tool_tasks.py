"""Tasks that need the Python tool but are not math problems: the tool-call part of the
non-reasoning SFT mixture.

The paper's SFT teaches function calling, instruction following and chat, with no math
reasoning; RL then draws the reasoning out of the base model. So these tasks (string and list
manipulation, counting characters, base conversion, calendar arithmetic) share no kind with the
generated math problems of tasks/data/problems.py that RL trains and evaluates on: what the SFT
policy learns from them is how to call the tool, read what it prints and report it.
Each task comes with its program and the answer that program prints.
"""

from __future__ import annotations

import datetime
import random
from collections.abc import Callable

# One line of nouns the words of string tasks are drawn from.
NOUNS = (
    "apple river stone cloud maple tiger lemon orbit candle violet harbor pepper meadow rocket "
    "silver garden falcon copper willow thunder saddle marble velvet canyon lantern shadow "
    "pebble blossom crystal mirror feather anchor"
)
WORDS = NOUNS.split()
WEEKDAYS = ("Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "Saturday", "Sunday")

Task = tuple[str, str, str]  # (question, program, the answer the program prints)


def _word(rng: random.Random) -> str:
    return rng.choice(WORDS)


def _phrase(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n))


def _reverse(rng: random.Random) -> Task:
    word = _word(rng) + _word(rng)
    return f'Reverse the string "{word}".', f's = "{word}"\nprint(s[::-1])', word[::-1]


def _count_letter(rng: random.Random) -> Task:
    phrase = _phrase(rng, rng.randint(2, 5))
    letter = rng.choice(sorted(set(phrase.replace(" ", ""))))
    return (
        f'How many times does the letter "{letter}" occur in "{phrase}"?',
        f'print("{phrase}".count("{letter}"))',
        str(phrase.count(letter)),
    )


def _count_words(rng: random.Random) -> Task:
    phrase = _phrase(rng, rng.randint(3, 9))
    return (
        f'How many words are in the text "{phrase}"?',
        f'words = "{phrase}".split()\nprint(len(words))',
        str(len(phrase.split())),
    )


def _sort_words(rng: random.Random) -> Task:
    words = rng.sample(WORDS, rng.randint(3, 6))
    listed = ", ".join(words)
    return (
        f"Sort these words alphabetically: {listed}.",
        f"words = {words!r}\nprint(' '.join(sorted(words)))",
        " ".join(sorted(words)),
    )


def _longest_word(rng: random.Random) -> Task:
    words = rng.sample(WORDS, rng.randint(3, 6))
    return (
        f"Which is the longest of the words {', '.join(words)}? Take the first one if several are.",
        f"words = {words!r}\nprint(max(words, key=len))",
        max(words, key=len),
    )


def _uppercase(rng: random.Random) -> Task:
    phrase = _phrase(rng, rng.randint(2, 4))
    return f'Write "{phrase}" in capital letters.', f'print("{phrase}".upper())', phrase.upper()


def _dedupe(rng: random.Random) -> Task:
    words = [rng.choice(WORDS[:8]) for _ in range(rng.randint(4, 8))]
    unique = list(dict.fromkeys(words))
    return (
        f"Remove the repeated words from {' '.join(words)}, keeping the first of each.",
        f"words = {words!r}\nprint(' '.join(dict.fromkeys(words)))",
        " ".join(unique),
    )


def _to_binary(rng: random.Random) -> Task:
    n = rng.randint(5, 5000)
    return f"Write {n} in binary.", f"print(bin({n})[2:])", bin(n)[2:]


def _from_hex(rng: random.Random) -> Task:
    text = f"{rng.randint(16, 65535):x}"
    return (
        f"Convert the hexadecimal number {text} to decimal.",
        f'print(int("{text}", 16))',
        str(int(text, 16)),
    )


def _date(rng: random.Random) -> datetime.date:
    return datetime.date(rng.randint(1950, 2049), 1, 1) + datetime.timedelta(days=rng.randint(0, 364))


def _weekday(rng: random.Random) -> Task:
    day = _date(rng)
    return (
        f"On which day of the week was {day.isoformat()}?",
        f'import datetime\nprint(datetime.date({day.year}, {day.month}, {day.day}).strftime("%A"))',
        WEEKDAYS[day.weekday()],
    )


def _days_between(rng: random.Random) -> Task:
    first, second = sorted((_date(rng), _date(rng)))
    return (
        f"How many days are there from {first.isoformat()} to {second.isoformat()}?",
        "import datetime\n"
        f"print((datetime.date({second.year}, {second.month}, {second.day}) - "
        f"datetime.date({first.year}, {first.month}, {first.day})).days)",
        str((second - first).days),
    )


TOOL_TASKS: dict[str, Callable[[random.Random], Task]] = {
    "reverse": _reverse,
    "count_letter": _count_letter,
    "count_words": _count_words,
    "sort_words": _sort_words,
    "longest_word": _longest_word,
    "uppercase": _uppercase,
    "dedupe": _dedupe,
    "to_binary": _to_binary,
    "from_hex": _from_hex,
    "weekday": _weekday,
    "days_between": _days_between,
}


def tool_tasks(n: int, rng: random.Random) -> list[Task]:
    """n tasks, their kinds drawn uniformly."""
    return [TOOL_TASKS[rng.choice(sorted(TOOL_TASKS))](rng) for _ in range(n)]


# Short chats: the assistant answers in words, with no tool and no answer block.
CHATS = (
    ("Hello!", "Hello! Ask me a question and I will answer it, with Python when it helps."),
    ("Who are you?", "I am a helpful assistant. I can run Python programs to answer questions."),
    ("Thank you.", "You are welcome."),
    ("Can you run code?", "Yes. I can call a Python tool and read what the program prints."),
    ("Good morning.", "Good morning! What would you like to know?"),
    ("What can you do?", "I answer questions and run Python programs when a question needs them."),
)

# Answer-format instructions: the assistant reports exactly what it is told, in the answer block.
INSTRUCTIONS = (
    "Reply with the number {number} as your final answer.",
    "Your final answer must be {number}.",
    "Give {number} as the answer, nothing else.",
    "Put {word} in the answer box.",
    "Answer with the word {word}.",
)


def instruction(rng: random.Random) -> tuple[str, str]:
    """(an answer-format instruction, the answer it asks for)."""
    number, word = rng.randint(0, 10**6), _word(rng)
    template = rng.choice(INSTRUCTIONS)
    return template.format(number=number, word=word), str(number) if "{number}" in template else word
