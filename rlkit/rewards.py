"""Reward functions and their safe execution.

A reward function is `fn(prompt: str, response: str, answer: str) -> float`. Built-ins are registered by
name (`math`, `format`); any other function is addressed by import path (`my_module:my_fn` or
`my_module.my_fn`). Functions run in worker processes with a per-call timeout: one that raises, returns
a non-number or hangs yields 0 for that sample and is counted in `reward/errors` (plus
`reward/timeouts`); the run never crashes or hangs because of a reward.

This module imports nothing heavy at import time: worker processes load it (spawn) in about a second.
"""

from __future__ import annotations

import functools
import importlib
import logging
import math
import multiprocessing as mp
import re
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

log = logging.getLogger(__name__)

_ANSWER_MARK = "####"


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


def math_reward(prompt: str, response: str, answer: str) -> float:
    """1.0 when the response's final answer equals the reference (math-verify), else 0.0.

    The response's answer is the text after `####` when present (our prompt asks for it), otherwise
    math-verify extracts the last number / boxed expression from the whole response.
    """
    from math_verify import parse, verify

    gold = parse(extract_gsm8k_answer(answer))
    if not gold:
        return 0.0
    pred = parse(_response_final(response))
    return 1.0 if pred and verify(gold, pred) else 0.0


_FORMAT_RE = re.compile(r"(####\s*-?[\d,]*\.?\d+)|(\\boxed\{[^}]*\})")


def format_reward(prompt: str, response: str, answer: str) -> float:
    """1.0 when the response states a final answer in the requested form (`#### N` or `\\boxed{...}`)."""
    return 1.0 if _FORMAT_RE.search(response) else 0.0


REGISTRY: dict[str, Callable[[str, str, str], float]] = {"math": math_reward, "format": format_reward}


@functools.cache
def resolve(spec: str) -> Callable[[str, str, str], float]:
    """A reward function from a registered name or an import path `module:fn` / `module.fn`."""
    if spec in REGISTRY:
        return REGISTRY[spec]
    if ":" in spec:
        module, _, name = spec.partition(":")
    elif "." in spec:
        module, _, name = spec.rpartition(".")
    else:
        raise ValueError(
            f"reward.fn={spec!r} is not one of {list(REGISTRY)} and is not an import path (module:fn or module.fn)"
        )
    try:
        fn = getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError) as e:
        raise ValueError(f"reward.fn={spec!r}: cannot import {name!r} from {module!r} ({e})") from e
    if not callable(fn):
        raise ValueError(f"reward.fn={spec!r} is not callable")
    return fn


def _call(spec: str, prompt: str, response: str, answer: str) -> tuple[float, str | None]:
    """Worker side: (reward, None) or (0.0, error description). Never raises."""
    try:
        value = float(resolve(spec)(prompt, response, answer))
        if not math.isfinite(value):
            return 0.0, f"non-finite reward {value}"
        return value, None
    except BaseException as e:  # a reward must never take the run down
        return 0.0, f"{type(e).__name__}: {e}"


def _init_worker() -> None:
    import math_verify  # noqa: F401  (sympy takes a second or two to import)


@dataclass
class Scores:
    """Rewards of one batch: `total[i]` = fn + sum(weight * extra); `per_fn[name][i]`; error counts."""

    total: list[float]
    per_fn: dict[str, list[float]]
    errors: int
    timeouts: int


class RewardScorer:
    """Scores (prompt, response, answer) triples with a weighted sum of reward functions.

    Args:
        fn: main reward (weight 1).
        extra: more reward functions and their weights.
        timeout_s: per-call limit; a call over it is abandoned (its worker killed) and scores 0.
        num_workers: worker processes.
        also: functions computed for metrics only (e.g. `math` for accuracy), weight 0.
    """

    def __init__(
        self,
        fn: str,
        extra: dict[str, float] | None = None,
        *,
        timeout_s: float = 10.0,
        num_workers: int = 2,
        also: Sequence[str] = (),
    ):
        self.weights: dict[str, float] = {fn: 1.0}
        for name, w in (extra or {}).items():
            self.weights[name] = self.weights.get(name, 0.0) + float(w)
        for name in also:
            self.weights.setdefault(name, 0.0)
        for name in self.weights:
            resolve(name)  # fail at start-up on a bad name, not in a worker
        self.timeout_s = timeout_s
        self.num_workers = num_workers
        self._pool = None

    def _get_pool(self):
        if self._pool is None:
            # spawn: no fork of a process holding torch threads / CUDA; workers import only this module.
            self._pool = mp.get_context("spawn").Pool(self.num_workers, initializer=_init_worker)
            # Wait until the workers have started and imported math-verify, so that start-up time is
            # not charged to the first reward call's timeout.
            warm = [self._pool.apply_async(time.sleep, (0.2,)) for _ in range(self.num_workers)]
            for h in warm:
                h.get(timeout=max(120.0, self.timeout_s))
        return self._pool

    def _kill_pool(self) -> None:
        if self._pool is not None:
            self._pool.terminate()
            self._pool.join()
            self._pool = None

    def close(self) -> None:
        self._kill_pool()

    def score(
        self,
        prompts: Sequence[str],
        responses: Sequence[str],
        answers: Sequence[str],
        *,
        only: Sequence[str] | None = None,
    ) -> Scores:
        """Score N samples (with the functions in `only`, default all). Calls finish in submission order;
        a call gets `timeout_s` from the moment every earlier call is done (so it is already running),
        which keeps the limit per call."""
        weights = {k: w for k, w in self.weights.items() if only is None or k in only}
        tasks = [(name, i) for name in weights for i in range(len(responses))]
        results: dict[tuple[str, int], float] = {}
        errors = timeouts = 0
        pending = list(tasks)
        while pending:
            pool = self._get_pool()
            handles = [
                (t, pool.apply_async(_call, (t[0], prompts[t[1]], responses[t[1]], answers[t[1]])))
                for t in pending
            ]
            pending = []
            for k, (task, handle) in enumerate(handles):
                try:
                    value, err = handle.get(timeout=self.timeout_s)
                except mp.TimeoutError:
                    log.warning(
                        "reward %r timed out after %.1fs on sample %d: scored 0",
                        task[0],
                        self.timeout_s,
                        task[1],
                    )
                    results[task] = 0.0
                    errors += 1
                    timeouts += 1
                    # The hung worker cannot be interrupted: kill the pool, resubmit what is unfinished.
                    done = {t: h.get() for t, h in handles[k + 1 :] if h.ready()}
                    for t, (v, e) in done.items():
                        results[t] = v
                        errors += e is not None
                    pending = [t for t, _ in handles[k + 1 :] if t not in done]
                    self._kill_pool()
                    break
                except Exception as e:  # e.g. an unpicklable result
                    value, err = 0.0, f"{type(e).__name__}: {e}"
                if err is not None:
                    errors += 1
                    log.debug("reward %r failed on sample %d: %s", task[0], task[1], err)
                results[task] = value
        per_fn = {name: [results[(name, i)] for i in range(len(responses))] for name in weights}
        total = [sum(w * per_fn[name][i] for name, w in weights.items()) for i in range(len(responses))]
        return Scores(total=total, per_fn=per_fn, errors=errors, timeouts=timeouts)
