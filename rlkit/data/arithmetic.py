"""The generated arithmetic set (`data.path=arithmetic`): GSM8K-format word problems made offline.

Each problem kind is registered with the number of distinct problems it can produce, computed from the
same ranges and word lists the generator draws from, so the start-up check of `data.num_train +
data.num_eval` and the generator cannot disagree.
"""

from __future__ import annotations

import json
import random
import shutil
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

SMALL = (1, 20)
TWO_DIGIT = (10, 99)
THREE_DIGIT = (100, 999)
NAMES = ("Tom", "Sara", "Ali", "Mia", "Ken", "Lea")
THINGS = ("apples", "pencils", "stickers", "marbles", "books")


def _count(span: tuple[int, int]) -> int:
    return span[1] - span[0] + 1


_STORIES = len(NAMES) * len(THINGS)


@dataclass(frozen=True)
class Kind:
    """A problem type: `build(rng, a, b, name, thing) -> (question, work, result)` and its distinct count."""

    build: Callable[[random.Random, int, int, str, str], tuple[str, str, int]]
    size: int
    default: bool = False


KINDS: dict[str, Kind] = {}


def kind(name: str, *, size: int, default: bool = False):
    """Register a problem kind (`data.arithmetic_kinds` takes its name)."""

    def register(build):
        KINDS[name] = Kind(build, size, default)
        return build

    return register


@kind("plain_add", size=_count(SMALL) ** 2, default=True)
def _plain_add(rng, a, b, name, thing):
    return f"What is {a} + {b}?", f"{a} + {b} = {a + b}", a + b


@kind("story_add", size=_count(SMALL) ** 2 * _STORIES, default=True)
def _story_add(rng, a, b, name, thing):
    question = f"{name} has {a} {thing}. {name} gets {b} more. How many {thing} does {name} have now?"
    return question, f"{a} + {b} = {a + b}", a + b


# a >= b: the pairs of SMALL on or below the diagonal
@kind("story_sub", size=_count(SMALL) * (_count(SMALL) + 1) // 2 * _STORIES, default=True)
def _story_sub(rng, a, b, name, thing):
    a, b = max(a, b), min(a, b)
    question = f"{name} had {a} {thing} and gave away {b}. How many {thing} are left?"
    return question, f"{a} - {b} = {a - b}", a - b


@kind("plain_mul", size=_count(THREE_DIGIT) ** 2)
def _plain_mul(rng, a, b, name, thing):
    a, b = rng.randint(*THREE_DIGIT), rng.randint(*THREE_DIGIT)
    return f"What is {a} * {b}?", f"{a} * {b} = {a * b}", a * b


@kind("plain_add2", size=_count(TWO_DIGIT) ** 2)
def _plain_add2(rng, a, b, name, thing):
    a, b = rng.randint(*TWO_DIGIT), rng.randint(*TWO_DIGIT)
    return f"What is {a} + {b}?", f"{a} + {b} = {a + b}", a + b


@kind("plain_add3", size=_count(SMALL) ** 3)
def _plain_add3(rng, a, b, name, thing):
    c = rng.randint(*SMALL)
    return f"What is {a} + {b} + {c}?", f"{a} + {b} + {c} = {a + b + c}", a + b + c


# c in 1..a+b for every pair (a, b) of SMALL
@kind("story_two_step", size=sum(a + b for a in range(SMALL[0], SMALL[1] + 1) for b in range(SMALL[0], SMALL[1] + 1)) * _STORIES)  # fmt: skip
def _story_two_step(rng, a, b, name, thing):
    c = rng.randint(1, a + b)
    question = f"{name} has {a} {thing}. {name} gets {b} more, then gives away {c}. How many {thing} does {name} have now?"
    return question, f"{a} + {b} = {a + b}, {a + b} - {c} = {a + b - c}", a + b - c


DEFAULT_KINDS = tuple(k for k, spec in KINDS.items() if spec.default)


def check_kinds(kinds) -> None:
    """`data.arithmetic_kinds` must be a non-empty list of registered kinds (raises ValueError)."""
    if not kinds or any(k not in KINDS for k in kinds):
        raise ValueError(f"data.arithmetic_kinds={list(kinds)} must be a non-empty subset of {list(KINDS)}")


def distinct_problems(kinds) -> int:
    """How many distinct problems `kinds` can produce."""
    return sum(KINDS[k].size for k in set(kinds))


def arithmetic_problem(rng: random.Random, kinds: tuple[str, ...] = DEFAULT_KINDS) -> dict:
    """One GSM8K-format problem of a kind drawn from `kinds`, answer ending in `#### N`."""
    a, b = rng.randint(*SMALL), rng.randint(*SMALL)
    name = rng.choice(list(NAMES))
    thing = rng.choice(list(THINGS))
    question, work, result = KINDS[rng.choice(kinds)].build(rng, a, b, name, thing)
    return {"question": question, "answer": f"{work}\n#### {result}"}


def generate_arithmetic(
    directory: str | Path,
    *,
    num_train: int,
    num_eval: int,
    seed: int = 0,
    kinds: tuple[str, ...] = DEFAULT_KINDS,
) -> Path:
    """Write `train.jsonl` and `test.jsonl` of arithmetic word problems into `directory` (atomically).

    The set is a pure function of (num_train, num_eval, seed, kinds); eval questions never appear in
    train. `kinds` picks the problem types among `KINDS`.
    """
    kinds = tuple(kinds)
    check_kinds(kinds)
    directory = Path(directory)
    if (directory / "train.jsonl").exists() and (directory / "test.jsonl").exists():
        return directory
    rng = random.Random(seed)
    seen: set[str] = set()
    rows: list[dict] = []
    # The space of distinct problems may be small; stop early rather than loop forever.
    for _ in range(50 * (num_train + num_eval)):
        if len(rows) == num_train + num_eval:
            break
        p = arithmetic_problem(rng, kinds)
        if p["question"] not in seen:
            seen.add(p["question"])
            rows.append(p)
    if len(rows) < num_train + num_eval:
        raise ValueError(
            f"data.num_train + data.num_eval = {num_train + num_eval} exceeds the {len(rows)} distinct "
            "arithmetic problems available"
        )
    return write_splits(directory, train=rows[num_eval:], test=rows[:num_eval])


def write_splits(directory: Path, *, train: list[dict], test: list[dict]) -> Path:
    """Write generated rows as `directory/{train,test}.jsonl`, atomically: a temporary folder renamed into
    place, so a reader never sees half a set and two processes generating the same set do not collide."""
    directory.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=directory.parent, prefix=f".tmp-{directory.name}-"))
    for name, part in (("test.jsonl", test), ("train.jsonl", train)):
        with open(tmp / name, "w") as f:
            f.writelines(json.dumps(r) + "\n" for r in part)
    try:
        tmp.rename(directory)
    except OSError:  # another process won the race; its copy is identical
        shutil.rmtree(tmp, ignore_errors=True)
    return directory
