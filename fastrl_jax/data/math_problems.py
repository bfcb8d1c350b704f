"""Verifiable grade-school math problems of graded difficulty, generated from (seed, index).

Problem i of a split is a pure function of (seed, i, levels): the same seed always gives the
same problems, so a training stream and a held-out set are two seeds, and a resumed run sees
exactly the problems it would have seen. A fifth of all questions (by a hash of the text) are held
out: only held-out streams ask them, so a held-out set never repeats a training problem, even at
the levels with few distinct questions (81 one-digit sums, 121 products). Levels go from one-digit sums (a 135M model gets some
right before any training, so RL has a signal) to two-step word problems. Answers are integers.

Used for RL prompts (fastrl_jax.data.pipeline) and as drafter-training prompts.
"""

from __future__ import annotations

import dataclasses
import hashlib

import numpy as np

LEVELS = (1, 2, 3, 4, 5)

_NAMES = ("Tom", "Ana", "Ben", "Mia", "Sam", "Lea", "Max", "Zoe", "Leo", "Ivy")
_ITEMS = ("apples", "books", "coins", "pens", "cards", "eggs", "shells", "stickers", "marbles", "cookies")


@dataclasses.dataclass(frozen=True)
class MathProblem:
    question: str
    answer: int
    level: int


def _level1(rng: np.random.Generator) -> tuple[str, int]:
    a, b = (int(x) for x in rng.integers(1, 10, 2))
    return f"What is {a} + {b}?", a + b


def _level2(rng: np.random.Generator) -> tuple[str, int]:
    a, b = (int(x) for x in rng.integers(10, 100, 2))
    if rng.random() < 0.5:
        return f"What is {a} + {b}?", a + b
    a, b = max(a, b), min(a, b)
    return f"What is {a} - {b}?", a - b


def _level3(rng: np.random.Generator) -> tuple[str, int]:
    a, b = (int(x) for x in rng.integers(2, 13, 2))
    return f"What is {a} * {b}?", a * b


def _level4(rng: np.random.Generator) -> tuple[str, int]:
    name, item = str(rng.choice(_NAMES)), str(rng.choice(_ITEMS))
    a, b = (int(x) for x in rng.integers(2, 20, 2))
    if rng.random() < 0.5:
        return f"{name} has {a} {item} and gets {b} more. How many {item} does {name} have now?", a + b
    a, b = a + b, min(a, b)
    return f"{name} has {a} {item} and gives away {b}. How many {item} does {name} have left?", a - b


def _level5(rng: np.random.Generator) -> tuple[str, int]:
    name, item = str(rng.choice(_NAMES)), str(rng.choice(_ITEMS))
    boxes, per_box, extra = int(rng.integers(2, 6)), int(rng.integers(2, 10)), int(rng.integers(1, 10))
    return (
        f"{name} has {boxes} boxes with {per_box} {item} in each box, and {extra} more {item}. "
        f"How many {item} does {name} have in total?",
        boxes * per_box + extra,
    )


_MAKERS = {1: _level1, 2: _level2, 3: _level3, 4: _level4, 5: _level5}


def is_held_out(question: str) -> bool:
    """Whether a question belongs to the held-out fifth (the same answer in every process and run)."""
    return hashlib.blake2b(question.encode(), digest_size=8).digest()[0] % 5 == 0


def problem(seed: int, index: int, levels: tuple[int, ...] = LEVELS, held_out: bool = False) -> MathProblem:
    """Problem `index` of the stream `seed`, its level drawn uniformly from `levels`; a training stream's problems
    are never held-out questions, a held-out stream's (held_out=True) always are (drawn again until they are)."""
    bad = [lv for lv in levels if lv not in _MAKERS]
    if not levels or bad:
        raise ValueError(f"math problem levels must be a non-empty subset of {LEVELS}; got {tuple(levels)}")
    rng = np.random.default_rng([seed, index])
    while True:
        level = int(levels[int(rng.integers(len(levels)))])
        question, answer = _MAKERS[level](rng)
        if is_held_out(question) == held_out:
            return MathProblem(question, answer, level)


def problems(seed: int, count: int, levels: tuple[int, ...] = LEVELS, start: int = 0,
             held_out: bool = False) -> list[MathProblem]:
    """Problems start .. start + count - 1 of the stream `seed`."""
    return [problem(seed, i, levels, held_out) for i in range(start, start + count)]
