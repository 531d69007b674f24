"""reasoning-gym tasks as data and reward (`data.path=reasoning_gym`, `data.tasks`, `reward.fn=reasoning_gym`).

reasoning-gym (https://github.com/open-thought/reasoning-gym) generates procedural reasoning tasks, each
with its own scorer. `data.tasks` names them: a list (`[chain_sum, leg_counting]`, an item may be
`{chain_sum: {max_terms: 3, weight: 2}}`: the task's reasoning-gym config plus an optional sampling weight)
or a mapping from a task to its config (`{chain_sum: {max_terms: 3}, leg_counting: {}}`). Rows come from reasoning-gym's composite dataset (`create_dataset("composite", ...)`) with
seeds far apart for the train and eval splits, and any training question that is also an eval question is
dropped, so no question is in both. Each row carries

    question, answer    the task's question and reference answer
    task                the task's name (per-task metrics key on this column)
    entry               the reasoning-gym entry as JSON (question, answer, metadata): what score_answer reads
    task_config         the task's reasoning-gym config as JSON (the scorer is built with it)

and the reward `reasoning_gym` is the task's own `score_answer` on reasoning-gym's `extract_answer` of the
response (the text inside the last <answer></answer> tags), so a score is exactly reasoning-gym's. The
library is imported only here and only when used.
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import math
import re
from collections.abc import Mapping
from pathlib import Path

from omegaconf import OmegaConf

from rlkit.config.schema import ConfigError
from rlkit.data.arithmetic import write_splits

log = logging.getLogger(__name__)

REASONING_GYM = "reasoning_gym"
INSTALL_HINT = 'reasoning-gym is not installed: pip install "rlkit[reasoning-gym]"'
WEIGHT = "weight"
"""The key of a task's entry in `data.tasks` that is its sampling weight, not a reasoning-gym config field."""
SYSTEM_PROMPT_PREFIX = "reasoning_gym:"
"""`data.system_prompt=reasoning_gym:<name>` uses reasoning-gym's system prompt <name> (its SYSTEM_PROMPTS)."""
TRAIN_SEED = 0
"""reasoning-gym seeds: item i of a task with seed s is drawn from Random(s + i), so the eval seed is placed
past every seed the training split uses (see `_eval_seed`)."""


def _library():
    try:
        import reasoning_gym
    except ImportError as e:
        raise ImportError(f"{INSTALL_HINT} ({e})") from e
    return reasoning_gym


def task_specs(tasks) -> list[tuple[str, float, dict]]:
    """(name, weight, reasoning-gym config) of every task of `data.tasks`: a mapping {name: config}, or a
    list whose items are names or one-entry mappings {name: config} (a config may hold a `weight`).

    The list form is what a command-line override can replace (Hydra merges a mapping into a mapping)."""
    if isinstance(tasks, str):
        tasks = [tasks]
    if isinstance(tasks, Mapping):
        items = list(tasks.items())
    else:
        items = []
        for item in tasks or []:
            if isinstance(item, Mapping):
                if len(item) != 1:
                    raise ConfigError(
                        f"data.tasks: a list item must be a task name or {{name: config}} with one name, not {item}"
                    )
                items.extend(item.items())
            else:
                items.append((item, {}))
    out = []
    for name, spec in items:
        if spec is not None and not isinstance(spec, Mapping):
            raise ConfigError(f"data.tasks.{name}={spec!r} must be a mapping of reasoning-gym config keys")
        spec = dict(spec or {})
        out.append((str(name), spec.pop(WEIGHT, 1.0), spec))
    return out


def check_tasks(tasks) -> None:
    """`data.tasks` names registered reasoning-gym tasks with valid configs and positive weights (ConfigError)."""
    specs = task_specs(tasks)
    if not specs:
        raise ConfigError(
            "data.tasks is empty: name reasoning-gym tasks, e.g. data.tasks=[chain_sum,leg_counting]"
        )
    rg = _library()
    from reasoning_gym.factory import DATASETS

    valid = sorted(n for n in DATASETS if n != "composite")
    seen = set()
    for name, weight, config in specs:
        if name not in valid:
            import difflib

            close = difflib.get_close_matches(name, valid, n=5, cutoff=0.5)
            hint = f"did you mean {close}? " if close else ""
            raise ConfigError(
                f"data.tasks: {name!r} is not a reasoning-gym task; {hint}the {len(valid)} tasks are {valid}"
            )
        if name in seen:
            raise ConfigError(f"data.tasks: {name!r} is listed twice")
        seen.add(name)
        if isinstance(weight, bool) or not isinstance(weight, (int, float)) or not 0 < weight < math.inf:
            raise ConfigError(f"data.tasks.{name}.weight={weight!r} must be a positive finite number")
        try:
            rg.create_dataset(name, **config, size=1, seed=0)
        except Exception as e:  # reasoning-gym raises TypeError / AssertionError / ValueError
            raise ConfigError(
                f"data.tasks.{name}: bad reasoning-gym config {config}: {type(e).__name__}: {e}"
            ) from e
    total = sum(float(weight) for _, weight, _ in specs)
    if not math.isfinite(total):  # reasoning-gym's composite refuses it only once the data is generated
        shown = {name: weight for name, weight, _ in specs}
        raise ConfigError(f"data.tasks: the weights {shown} add up to {total}: they must have a finite total")


@functools.cache
def system_prompt(name: str) -> str:
    """reasoning-gym's system prompt `name` (`data.system_prompt=reasoning_gym:<name>`)."""
    _library()
    from reasoning_gym.utils import SYSTEM_PROMPTS

    if name not in SYSTEM_PROMPTS:
        raise ConfigError(
            f"data.system_prompt={SYSTEM_PROMPT_PREFIX + name!r}: {name!r} is not one of reasoning-gym's "
            f"system prompts {list(SYSTEM_PROMPTS)}"
        )
    return SYSTEM_PROMPTS[name]


def _composite(specs, seed: int, size: int):
    from reasoning_gym.composite import DatasetSpec

    datasets = [DatasetSpec(name=n, weight=float(w), config=dict(c)) for n, w, c in specs]
    return _library().create_dataset("composite", seed=seed, size=size, datasets=datasets)


def _eval_seed(num_tasks: int, num_rows: int) -> int:
    # The composite gives task i the seed s + i + 1; item j of it draws from Random(seed + j).
    return TRAIN_SEED + num_tasks + num_rows + 1_000_003


def _rows(specs, seed: int, size: int) -> list[dict]:
    configs = {n: json.dumps(c, sort_keys=True) for n, _, c in specs}
    rows = []
    for entry in _composite(specs, seed, size):
        task = entry["metadata"]["source_dataset"]
        rows.append(
            {
                "question": entry["question"],
                "answer": str(entry["answer"]),
                "task": task,
                # default=str: values JSON cannot hold (gsm_symbolic's metadata has Fractions) become strings
                "entry": json.dumps(entry, default=str),
                "task_config": configs[task],
            }
        )
    return rows


def generate(directory: Path, tasks, *, num_train: int, num_eval: int) -> Path:
    """Write `train.jsonl` and `test.jsonl` of `tasks` into `directory` (atomically; kept once written).

    Eval has `num_eval` rows; train has at most `num_train`: those whose question is also an eval question
    are dropped (logged), so no question is in both splits.
    """
    directory = Path(directory)
    if (directory / "train.jsonl").exists() and (directory / "test.jsonl").exists():
        return directory
    specs = task_specs(tasks)
    eval_rows = _rows(specs, _eval_seed(len(specs), num_train), num_eval)
    held_out = {r["question"] for r in eval_rows}
    train_rows = [r for r in _rows(specs, TRAIN_SEED, num_train) if r["question"] not in held_out]
    if len(train_rows) < num_train:
        log.warning(
            "reasoning_gym: dropped %d of %d training rows whose question is also an eval question",
            num_train - len(train_rows), num_train,
        )  # fmt: skip
    if not train_rows:
        raise ValueError(f"reasoning_gym: every training question of {tasks} is an eval question")
    return write_splits(directory, train=train_rows, test=eval_rows)


def cache_name(tasks, num_train: int, num_eval: int) -> str:
    """A directory name that changes with everything the rows depend on (the library's version included)."""
    key = json.dumps(
        [task_specs(tasks), num_train, num_eval, _library().__version__, TRAIN_SEED],
        sort_keys=True,
        default=str,
    )
    return f"reasoning_gym-{hashlib.sha256(key.encode()).hexdigest()[:16]}"


@functools.cache
def _scorer(task: str, task_config: str):
    return _library().create_dataset(task, **json.loads(task_config)).score_answer


def tagged_answer(response: str) -> str | None:
    """reasoning-gym's `extract_answer`: the text inside the last <answer></answer> tags, None without them."""
    _library()
    from reasoning_gym.utils import extract_answer

    return extract_answer(response)


_LAST_NUMBER = re.compile(r"-?\d+(?:\.\d+)?")


def lenient_answer(response: str) -> str | None:
    """The answer in the last <answer></answer> tags (reasoning-gym's `extract_answer`); without tags, the
    last number written in the response (for numeric tasks and a model that answers in prose)."""
    tagged = tagged_answer(response)
    if tagged is not None:
        return tagged
    numbers = _LAST_NUMBER.findall(response.replace(",", ""))
    return numbers[-1] if numbers else None


def score(response: str, task: str, entry: str, task_config: str, *, lenient: bool = False) -> float:
    """reasoning-gym's score of `response`: the task's `score_answer` on `extract_answer(response)` (with
    `lenient`, on `lenient_answer(response)`)."""
    answer = lenient_answer(response) if lenient else tagged_answer(response)
    return float(_scorer(task, task_config)(answer, json.loads(entry)))


def has_answer(response: str) -> bool:
    """Whether reasoning-gym's `extract_answer` finds an answer (<answer>...</answer>) in `response`."""
    return tagged_answer(response) is not None


def plain(tasks):
    """`data.tasks` as plain Python containers (from an OmegaConf node)."""
    return OmegaConf.to_container(tasks, resolve=True) if OmegaConf.is_config(tasks) else tasks
