"""Reward functions: the contract, the built-ins and the registry (their safe execution: rlkit/rewards/scorer.py).

The contract. A reward function is

    def my_reward(prompt: str, response: str, answer: str, **columns) -> float

`prompt` is the templated prompt text, `response` the decoded response, `answer` the row's reference
answer (`data.answer_key`), and the function also receives, as keyword arguments, the columns of its
dataset row that its signature names (every column when it takes `**columns`), e.g. test cases, units,
a tolerance or `data_source`. A function decorated with `@batched` is called once per batch (per
route) with lists instead: `fn(prompts, responses, answers, **columns_as_lists) -> list[float]`, for
a model or a service with its own concurrency. `reward.route_by: data_source` picks the main reward
of each sample by that column's value (`reward.routes: {value: fn}`, `reward.fn` for other values).

Built-ins are registered by name (`math`, `exact`: the last word of the answer, `format`, `none`: 0 for everything, `reasoning_gym`: the task's
own scorer, rlkit/data/reasoning_gym.py; `reasoning_gym_lenient`: the same, a response without tags scored on its last number; `answer_tags`: 1 for an answer in <answer></answer> tags); any other function is addressed by import path
(`my_module:my_fn` or `my_module.my_fn`). What counts as *correct* (accuracy, pass@k, the refill filter)
is the main reward function's verdict: a reward >= `reward.correct_threshold` unless the function declares
its own with `@correct_when`.

This module holds the contract, the built-ins and the registry; rlkit/rewards/scorer.py runs them in worker
processes. It imports nothing heavy at import time: worker processes load it (spawn) in about a second.
"""

from __future__ import annotations

import functools
import logging
import math
import re
import reprlib
from collections.abc import Callable
from pathlib import Path

from rlkit.config.schema import ConfigError
from rlkit.data import reasoning_gym
from rlkit.lookup import lookup
from rlkit.model_files import read_regular

log = logging.getLogger(__name__)

_ANSWER_MARK = "####"

# The largest reward magnitude accepted. A batch's statistics (sums, squares for the std, the advantages)
# must stay finite in float32 (max ~3.4e38): 1e6 squared times a batch of a million samples still does.
# A reward beyond it scores 0 and counts in `reward/errors`, like a non-finite one.
MAX_ABS_REWARD = 1e6


def extract_gsm8k_answer(answer: str) -> str:
    """The final answer of a GSM8K reference solution (text after `####`, thousands commas removed)."""
    if _ANSWER_MARK in answer:
        answer = answer.split(_ANSWER_MARK)[-1]
    return answer.strip().replace(",", "")


def _response_final(response: str) -> str:
    """What to verify in a response: the text after its last `####` if any, else the whole response."""
    if _ANSWER_MARK in response:
        return response.split(_ANSWER_MARK)[-1].strip().replace(",", "")
    return response


_FRACTION = re.compile(r"^\s*-?\d+\s*/\s*\d+\s*$")


def _is_number(parsed: list) -> bool:
    """A math-verify parse that is a single number: an integer, decimal or fraction, not a sum or product."""
    import sympy

    return isinstance(parsed[0], sympy.Number) or bool(_FRACTION.match(str(parsed[-1])))


def math_reward(prompt: str, response: str, answer: str) -> float:
    """1.0 when the response's final answer equals the reference (math-verify), else 0.0.

    The response's answer is the text after `####` when present (our prompt asks for it), otherwise
    math-verify extracts the last number / boxed expression from the whole response. When the reference
    is a number, the answer must be a number too: math-verify evaluates an expression, so a response that
    restates the question ("7 + 15" for "What is 7 + 15?") would otherwise score as the right answer, and
    a policy learns exactly that.
    """
    from math_verify import parse, verify

    gold = parse(extract_gsm8k_answer(answer))
    if not gold:
        return 0.0
    pred = parse(_response_final(response))
    if not pred or (_is_number(gold) and not _is_number(pred)):
        return 0.0
    return 1.0 if verify(gold, pred) else 0.0


_FORMAT_RE = re.compile(r"(####\s*-?[\d,]*\.?\d+)|(\\boxed\{[^}]*\})")


def format_reward(prompt: str, response: str, answer: str) -> float:
    """1.0 when the response states a final answer in the requested form (`#### N` or `\\boxed{...}`)."""
    return 1.0 if _FORMAT_RE.search(response) else 0.0


def no_reward(prompt: str, response: str, answer: str) -> float:
    """0 for every response: no task reward (pure on-policy distillation, or a reward model's score alone)."""
    return 0.0


def correct_when(verdict: Callable[[float], bool]) -> Callable:
    """Declare what counts as correct for a reward function: `verdict(reward) -> bool`.

    "Correct" is the task's word: `accuracy`, `eval/pass@k` and the refill filter `filter_metric=accuracy`
    ask the main reward function (`reward.fn`, or the sample's route). Without a declaration a reward of at
    least `reward.correct_threshold` (default 1.0) is correct; `math` returns 1.0 exactly when math-verify
    accepts the answer, so it needs none.

        @correct_when(lambda r: r > 0.9)
        def close_enough(prompt, response, answer) -> float: ...
    """

    def mark(fn: Callable) -> Callable:
        fn.rlkit_correct = verdict
        return fn

    return mark


@correct_when(lambda r: r >= 1.0)
def reasoning_gym_reward(
    prompt: str, response: str, answer: str, task: str, entry: str, task_config: str
) -> float:
    """reasoning-gym's own score of the response (`data.path=reasoning_gym`): the row's task's `score_answer`
    on reasoning-gym's `extract_answer` (the last <answer>...</answer>), partial credit included; correct
    is a score of 1. The row's `task`, `entry` and `task_config` columns say what to score against."""
    return reasoning_gym.score(response, task, entry, task_config)


@correct_when(lambda r: r >= 1.0)
def reasoning_gym_lenient_reward(
    prompt: str, response: str, answer: str, task: str, entry: str, task_config: str
) -> float:
    """`reasoning_gym`, but a response without <answer></answer> tags is scored on its last number
    (`reasoning_gym.lenient_answer`): a signal from the first step for a small model that answers numeric
    tasks in prose. Not reasoning-gym's contract: report accuracies measured with it as such."""
    return reasoning_gym.score(response, task, entry, task_config, lenient=True)


def answer_tags_reward(prompt: str, response: str, answer: str) -> float:
    """1.0 when reasoning-gym's `extract_answer` finds an answer in <answer></answer> tags, else 0.0: a format
    term (`reward.extra={answer_tags: 0.2}`) for a model that does not use the tags on its own yet."""
    return 1.0 if reasoning_gym.has_answer(response) else 0.0


_WORD = re.compile(r"[a-z0-9]+")


def word_answer(response: str) -> str | None:
    """The `exact` reward's answer: the last word of the response's final answer (the text after its last
    `####`, else the whole response), lower-cased; None without a word."""
    words = _WORD.findall(_response_final(response).lower())
    return words[-1] if words else None


def exact_reward(prompt: str, response: str, answer: str) -> float:
    """1.0 when the last word of the response's final answer equals the reference (case and punctuation
    ignored: "Red." and "The shape is red" answer "red"), else 0.0. For one-word answers that math-verify does
    not read, such as the colour names of the generated pictures (rlkit/data/pictures.py)."""
    return 1.0 if word_answer(response) == (word_answer(extract_gsm8k_answer(answer)) or "") else 0.0


REGISTRY: dict[str, Callable[[str, str, str], float]] = {
    "math": math_reward,
    "format": format_reward,
    "none": no_reward,
    "reasoning_gym": reasoning_gym_reward,
    "reasoning_gym_lenient": reasoning_gym_lenient_reward,
    "answer_tags": answer_tags_reward,
    "exact": exact_reward,
}


@functools.cache
def resolve(spec: str) -> Callable[[str, str, str], float]:
    """A reward function from a registered name or an import path `module:fn` / `module.fn`."""
    return lookup(spec, REGISTRY, key="reward.fn")


def batched(fn: Callable) -> Callable:
    """Mark a reward function as batched: called once per batch with lists, returns one float per sample."""
    fn.rlkit_batched = True
    return fn


def is_batched(spec: str) -> bool:
    return bool(getattr(resolve(spec), "rlkit_batched", False))


def is_correct(spec: str, value: float, threshold: float) -> bool:
    """The verdict of reward function `spec` on its value `value` (see `correct_when`)."""
    verdict = getattr(resolve(spec), "rlkit_correct", None)
    return bool(verdict(value)) if verdict is not None else value >= threshold


def answer_with(parser: Callable[[str], str | None]) -> Callable:
    """Declare how to extract a reward function's final answer from a response, for maj@k voting
    (rlkit.eval): `parser(response) -> str | None` (None: no answer, the sample does not vote). Two responses
    vote together when their parsed answers are equal strings. `math` declares its own (math-verify's
    parse of the final answer); a function without one uses `final_answer`.

        @answer_with(lambda response: response.strip().split()[-1] if response.strip() else None)
        def last_word(prompt, response, answer) -> float: ...
    """

    def mark(fn: Callable) -> Callable:
        fn.rlkit_answer = parser
        return fn

    return mark


def final_answer(response: str) -> str | None:
    """The default answer of a response: the text after its last `####` (commas removed), None without one."""
    if _ANSWER_MARK not in response:
        return None
    return response.split(_ANSWER_MARK)[-1].strip().replace(",", "") or None


def math_answer(response: str) -> str | None:
    """The math reward's answer: math-verify's parse of the final answer (what `math_reward` verifies),
    as a string, so "46", "46.0" and "\\boxed{46}" vote together; None when nothing parses."""
    from math_verify import parse

    parsed = parse(_response_final(response))
    if not parsed:
        return None
    value = parsed[0]
    try:  # a number votes by its value (46 and 46.0 agree)
        import sympy

        if isinstance(value, sympy.Number):
            value = sympy.nsimplify(value)
    except Exception:  # math-verify's objects are sympy's, but a failure to simplify only costs a split vote
        pass
    return str(value)


math_reward.rlkit_answer = math_answer
# What its first call imports: each reward worker of a run that scores with it imports it at start (scorer.py)
math_reward.rlkit_imports = ("math_verify",)
exact_reward.rlkit_answer = word_answer
reasoning_gym_reward.rlkit_answer = reasoning_gym.tagged_answer  # maj@k votes on the tagged answers
reasoning_gym_lenient_reward.rlkit_answer = reasoning_gym.lenient_answer


def extract_answer(spec: str, response: str) -> str | None:
    """The answer reward function `spec` reads in `response` (see `answer_with`); never raises (None)."""
    parser = getattr(resolve(spec), "rlkit_answer", final_answer)
    try:
        out = parser(response)
    except Exception as e:  # a parser must never take an evaluation down: the sample does not vote
        log.debug("answer parser of %s raised %s: %s", spec, type(e).__name__, e)
        return None
    return None if out is None else str(out)


_FIXED = ("prompt", "response", "answer", "prompts", "responses", "answers")


@functools.cache
def _wanted_columns(spec: str) -> tuple[bool, frozenset[str]]:
    """(takes **kwargs, the other parameter names) of a reward function's signature."""
    import inspect

    params = inspect.signature(resolve(spec)).parameters.values()
    var_kw = any(p.kind is p.VAR_KEYWORD for p in params)
    names = {p.name for p in params if p.kind in (p.KEYWORD_ONLY, p.POSITIONAL_OR_KEYWORD)}
    return var_kw, frozenset(names - set(_FIXED))


def _columns_for(spec: str, row: dict) -> dict:
    var_kw, names = _wanted_columns(spec)
    return {k: v for k, v in row.items() if k not in _FIXED and (var_kw or k in names)}


def describe(value) -> str:
    """A short description of any value for an error message: its type, its size and a truncated repr
    (reprlib), so a 5-million-element list or a 50 MB string is named, never printed."""
    try:
        size = f" of {len(value)} {'characters' if isinstance(value, str) else 'elements'}"
    except Exception:
        size = ""
    try:
        shown = reprlib.repr(value)
    except Exception:
        shown = "(unprintable)"
    return f"{type(value).__name__}{size}: {shown}"


def reward_number(value, what: str = "reward") -> float:
    """The one rule for every reward, of reward functions and of environment steps alike: a real number
    (anything with `__float__`: int, float, numpy and one-element torch scalars; bools count as 0 / 1),
    finite, with |value| <= MAX_ABS_REWARD. Anything else raises (TypeError / ValueError) with a short
    message: strings such as "0.5" are refused, not parsed."""
    if isinstance(value, (str, bytes)) or not hasattr(type(value), "__float__"):
        raise TypeError(f"non-numeric {what}: {describe(value)}")
    try:
        number = float(value)
    except Exception as e:
        raise TypeError(f"non-numeric {what}: {describe(value)} ({type(e).__name__})") from None
    if not math.isfinite(number):
        raise ValueError(f"non-finite {what} {number}")
    if abs(number) > MAX_ABS_REWARD:
        raise ValueError(
            f"{what} {number:g} out of range: |{what}| must be <= {MAX_ABS_REWARD:g} (MAX_ABS_REWARD)"
        )
    return number


def _number(value) -> tuple[float, str | None]:
    try:
        return reward_number(value), None
    except (TypeError, ValueError) as e:
        return 0.0, str(e)


def call_reward(spec: str, items: list[tuple]) -> list[tuple[float, str | None]]:
    """Worker side: one (reward, None) or (0.0, error description) per item. Never raises.

    `items` are (prompt, response, answer, row) tuples: one for a per-sample function, the batch for a
    batched one.
    """
    try:
        fn = resolve(spec)
        if not getattr(fn, "rlkit_batched", False):
            ((prompt, response, answer, row),) = items
            return [_number(fn(prompt, response, answer, **_columns_for(spec, row)))]
        columns = {k: [_columns_for(spec, it[3])[k] for it in items] for k in _columns_for(spec, items[0][3])}
        values = list(
            fn([it[0] for it in items], [it[1] for it in items], [it[2] for it in items], **columns)
        )
        if len(values) != len(items):
            raise ValueError(f"batched reward returned {len(values)} values for {len(items)} samples")
        return [_number(v) for v in values]
    except MemoryError:
        return [(0.0, "MemoryError: over the worker's memory cap (reward.memory_limit_mb)")] * len(items)
    except BaseException as e:  # a reward must never take the run down
        return [(0.0, f"{type(e).__name__}: {e}"[:500])] * len(items)


OVERLONG_PENALTY_WARN = 10.0
"""A reward.overlong_penalty above this is legal but almost surely wrong (logged at start-up)."""


def check_config(cfg) -> None:
    """The `reward.*` keys of an `RLConfig`: every function resolves, weights are finite, routes are
    complete (raises ConfigError before any model loads)."""
    # rlkit.config.rules brings torch (through rlkit.algos): reward workers import this module and start fast.
    from rlkit.config.rules import local_path_exists, nonempty

    w = cfg.reward
    nonempty("reward.fn", w.fn)
    routes = [(f"reward.routes.{k}", v) for k, v in w.routes.items()]
    for key, spec in [("reward.fn", w.fn), *((f"reward.extra.{k}", k) for k in w.extra), *routes]:
        try:
            resolve(spec)
        except ValueError as e:
            raise ConfigError(f"{key}: {e}") from e
    for k, weight in w.extra.items():
        if weight is None or not math.isfinite(weight):
            raise ConfigError(f"reward.extra.{k}={weight!r} must be a finite weight")
    if w.routes and w.route_by is None:
        raise ConfigError(
            f"reward.routes={dict(w.routes)} needs reward.route_by=<dataset column> to choose a route"
        )
    if w.model is not None and not w.model.strip():
        raise ConfigError(
            "reward.model='' is not a model: give a hub id or local directory, or null for none"
        )
    local_path_exists("reward.model", w.model)
    if w.model is not None:
        _check_reward_model(w.model)
    # An environment other than single_turn may reward its episodes itself (a verifiers rubric, OpenEnv).
    if (
        w.fn == "none"
        and w.model is None
        and not w.extra
        and cfg.algo.distill_coef == 0
        and (cfg.env.name == "single_turn")
    ):
        raise ConfigError(
            "reward.fn=none with no reward.model, no reward.extra and algo.distill_coef=0: nothing to learn "
            "from; name a reward function, an environment that rewards its episodes (env.name), or distill from "
            "a teacher (algo.distill_coef > 0, algo.teacher.path)"
        )
    if w.route_by is not None and not w.routes:
        log.warning(
            "reward.route_by=%r without reward.routes: every sample is scored by reward.fn=%r; add "
            "reward.routes.<value>=<function> or drop reward.route_by", w.route_by, w.fn,
        )  # fmt: skip
    if w.overlong_penalty > OVERLONG_PENALTY_WARN:
        log.warning(
            "reward.overlong_penalty=%g swamps the reward scale (the built-in rewards are in [0, 1]): an overlong "
            "sample's penalty drowns every other reward of its group; use a value near 1", w.overlong_penalty,
        )  # fmt: skip
    if w.overlong_buffer > cfg.rollout.max_new_tokens:
        raise ConfigError(
            f"reward.overlong_buffer={w.overlong_buffer} must be <= "
            f"rollout.max_new_tokens={cfg.rollout.max_new_tokens} (the penalty zone ends at the cap)"
        )


def _check_reward_model(path: str) -> None:
    """reward.model's folder before any model loads (before: after the policy loaded): its files
    (rlkit.model_files.check_model_folder) and a config.json of a sequence-classification model with one output."""
    import json

    from rlkit.config.rules import model_folder_ok

    model_folder_ok("reward.model", path)
    config_file = Path(path).expanduser() / "config.json"
    if not config_file.is_file():
        return  # a hub id, a short name or a GGUF file: checked when it loads
    config = json.loads(read_regular(config_file))
    labels = (
        len(config["id2label"]) if isinstance(config.get("id2label"), dict) else config.get("num_labels", 2)
    )
    heads = [a for a in config.get("architectures") or [] if not a.endswith("ForSequenceClassification")]
    if labels != 1 or heads:
        raise ConfigError(
            f"reward.model={path!r} must be a sequence-classification model with one output: its config.json "
            f"has {labels} labels and architectures {config.get('architectures')}"
        )
