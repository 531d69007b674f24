"""Reward functions and their safe execution.

The contract. A reward function is

    def my_reward(prompt: str, response: str, answer: str, **columns) -> float

`prompt` is the templated prompt text, `response` the decoded response, `answer` the row's reference
answer (`data.answer_key`), and the function also receives, as keyword arguments, the columns of its
dataset row that its signature names (every column when it takes `**columns`), e.g. test cases, units,
a tolerance or `data_source`. A function decorated with `@batched` is called once per batch (per
route) with lists instead: `fn(prompts, responses, answers, **columns_as_lists) -> list[float]`, for
a model or a service with its own concurrency. `reward.route_by: data_source` picks the main reward
of each sample by that column's value (`reward.routes: {value: fn}`, `reward.fn` for other values).

Built-ins are registered by name (`math`, `format`); any other function is addressed by import path
(`my_module:my_fn` or `my_module.my_fn`). Functions run in worker processes with a per-call timeout: one that raises, returns
a non-number, hangs or kills its process (os._exit, a segfault) yields 0 for that sample and is counted
in `reward/errors` (plus `reward/timeouts`); the run never crashes or hangs because of a reward.

This module imports nothing heavy at import time: worker processes load it (spawn) in about a second.
"""

from __future__ import annotations

import functools
import logging
import math
import multiprocessing as mp
import multiprocessing.connection as mp_connection
import re
import time
from collections import deque
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


REGISTRY: dict[str, Callable[[str, str, str], float]] = {"math": math_reward, "format": format_reward}


@functools.cache
def resolve(spec: str) -> Callable[[str, str, str], float]:
    """A reward function from a registered name or an import path `module:fn` / `module.fn`."""
    from rlkit.lookup import lookup

    return lookup(spec, REGISTRY, key="reward.fn")


def batched(fn: Callable) -> Callable:
    """Mark a reward function as batched: called once per batch with lists, returns one float per sample."""
    fn.rlkit_batched = True
    return fn


def is_batched(spec: str) -> bool:
    return bool(getattr(resolve(spec), "rlkit_batched", False))


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


def _number(value) -> tuple[float, str | None]:
    try:
        value = float(value)
    except (TypeError, ValueError) as e:
        return 0.0, f"non-numeric reward {value!r} ({e})"
    if not math.isfinite(value):
        return 0.0, f"non-finite reward {value}"
    return value, None


def _call(spec: str, items: list[tuple]) -> list[tuple[float, str | None]]:
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
    except BaseException as e:  # a reward must never take the run down
        return [(0.0, f"{type(e).__name__}: {e}")] * len(items)


def _init_worker() -> None:
    import math_verify  # noqa: F401  (sympy takes a second or two to import)


def _die_with_parent(parent_pid: int) -> None:
    """Linux: the kernel SIGKILLs this process when its parent dies, so no worker outlives the trainer."""
    import ctypes
    import os
    import signal

    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, int(signal.SIGKILL))  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        return  # not Linux: an idle worker still exits when its pipe closes (EOF)
    if os.getppid() != parent_pid:  # the parent died before prctl took effect
        os._exit(1)


def _worker_main(conn, parent_pid: int) -> None:
    """A reward worker: one private pipe to the trainer, no lock shared with any other process.

    It ignores SIGINT / SIGTERM: a signal sent to the whole process group (Ctrl-C, `timeout`, Slurm,
    systemd) is the trainer's to handle; the trainer finishes its step with intact rewards and then kills
    its workers. It exits when the trainer closes the pipe and is killed by the kernel when the trainer dies.
    """
    import signal

    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    _die_with_parent(parent_pid)
    _init_worker()
    conn.send("ready")
    while True:
        try:
            task = conn.recv()
        except (EOFError, OSError):
            return
        if task is None:
            return
        conn.send(_call(*task))


class _Worker:
    """One worker process and its pipe; `task` is the (name, index) it is running, `deadline` its limit."""

    def __init__(self, ctx, start_timeout_s: float):
        import os

        self.conn, child = ctx.Pipe(duplex=True)
        self.proc = ctx.Process(target=_worker_main, args=(child, os.getpid()), daemon=True)
        self.proc.start()
        child.close()
        self.ready = False
        self.task: tuple[str, int] | None = None
        self.deadline = time.monotonic() + start_timeout_s  # to start, then per task

    def kill(self) -> None:
        """SIGKILL and reap: never waits on anything the worker holds (a stopped or hung worker dies too)."""
        if self.proc.is_alive():
            self.proc.kill()
        self.proc.join(timeout=10)
        self.conn.close()


@dataclass
class Scores:
    """Rewards of one batch: `total[i]` = fn + sum(weight * extra); `per_fn[name][i]`; error counts."""

    total: list[float]
    per_fn: dict[str, list[float]]
    errors: int
    timeouts: int


class RewardScorer:
    """Scores samples with a weighted sum of reward functions (see the module doc for the contract).

    Args:
        fn: main reward (weight 1).
        extra: more reward functions and their weights.
        timeout_s: per-call limit; a call over it is abandoned (its worker killed) and scores 0.
        num_workers: worker processes.
        also: functions computed for metrics only (e.g. `math` for accuracy), weight 0.
        route_by: a dataset column whose value picks each sample's main reward from `routes`
            (`fn` for values not listed); None = `fn` for every sample.
        routes: column value -> reward function.
        batch_timeout_s: the limit of one call of a batched function.
    """

    def __init__(
        self,
        fn: str,
        extra: dict[str, float] | None = None,
        *,
        timeout_s: float = 10.0,
        num_workers: int = 2,
        also: Sequence[str] = (),
        route_by: str | None = None,
        routes: dict[str, str] | None = None,
        batch_timeout_s: float = 60.0,
    ):
        self.main = fn
        self.weights: dict[str, float] = {fn: 1.0}
        for name, w in (extra or {}).items():
            self.weights[name] = self.weights.get(name, 0.0) + float(w)
        for name in also:
            self.weights.setdefault(name, 0.0)
        self.route_by, self.routes = route_by, dict(routes or {})
        for name in [*self.weights, *self.routes.values()]:
            resolve(name)  # fail at start-up on a bad name, not in a worker
        self.timeout_s = timeout_s
        self.batch_timeout_s = batch_timeout_s
        self.num_workers = num_workers
        self.start_timeout_s = max(120.0, timeout_s)
        self._workers: list[_Worker] = []
        self._start_failures = 0
        self._ctx = mp.get_context("spawn")  # no fork of a process holding torch threads / CUDA

    def _spawn(self) -> _Worker:
        return _Worker(self._ctx, self.start_timeout_s)

    def close(self) -> None:
        """Kill the workers (they are stateless); safe to call twice, never blocks on a worker."""
        workers, self._workers = self._workers, []
        for w in workers:
            w.kill()

    def _tasks(
        self, weights: dict[str, float], rows: Sequence[dict]
    ) -> list[tuple[str, str, tuple[int, ...]]]:
        """(slot, function, sample indices) calls: per sample, or one per slot and route when batched."""
        tasks = []
        for slot in weights:
            by_spec: dict[str, list[int]] = {}
            for i, row in enumerate(rows):
                spec = slot
                if slot == self.main and self.route_by is not None:
                    if self.route_by not in row:
                        raise KeyError(
                            f"reward.route_by={self.route_by!r} is not a column of the dataset: {sorted(row)}"
                        )
                    spec = self.routes.get(str(row[self.route_by]), slot)
                by_spec.setdefault(spec, []).append(i)
            for spec, idx in by_spec.items():
                if is_batched(spec):
                    tasks.append((slot, spec, tuple(idx)))
                else:
                    tasks += [(slot, spec, (i,)) for i in idx]
        return sorted(tasks, key=lambda t: t[2][0])  # sample order, so early samples finish first

    def score(
        self,
        prompts: Sequence[str],
        responses: Sequence[str],
        answers: Sequence[str],
        *,
        rows: Sequence[dict] | None = None,
        only: Sequence[str] | None = None,
    ) -> Scores:
        """Score N samples (with the functions in `only`, default all); `rows[i]` holds sample i's dataset
        columns (default: none).

        Each call runs on an idle worker and gets `timeout_s` from the moment it is sent there (worker
        start-up is not charged to it). A call over its limit scores 0 and its worker is killed and
        replaced; a worker that dies (crash, segfault, OOM killer, kill -9) is seen at once through its
        process sentinel, and its call scores 0 and counts in `errors`. Workers share no lock or queue, so
        a dead worker can never block the others or `close()`.
        """
        weights = {k: w for k, w in self.weights.items() if only is None or k in only}
        rows = rows if rows is not None else [{}] * len(responses)
        queue = deque(self._tasks(weights, rows))
        results: dict[tuple[str, int], float] = {}
        errors = timeouts = 0

        def replace(w: _Worker, why: str, *, timeout: bool = False) -> None:
            nonlocal errors, timeouts
            if w.task is not None:
                slot, spec, idx = w.task
                log.warning("reward %r %s on sample(s) %s: scored 0", spec, why, list(idx))
                for i in idx:
                    results[(slot, i)] = 0.0
                errors += len(idx)
                timeouts += timeout * len(idx)
            else:
                log.warning("a reward worker (pid %s) %s while idle: replaced", w.proc.pid, why)
            if not w.ready:
                self._start_failures += 1
                if self._start_failures >= 3:
                    raise RuntimeError(
                        f"reward workers fail to start ({why}, {self._start_failures} times in a row): "
                        f"check that reward.fn / reward.extra import in a fresh process"
                    )
            w.kill()
            self._workers[self._workers.index(w)] = self._spawn()

        while queue or any(w.task is not None for w in self._workers):
            self._workers += [self._spawn() for _ in range(self.num_workers - len(self._workers))]
            for w in self._workers:
                if w.ready and w.task is None and queue:
                    w.task = queue.popleft()
                    _, spec, idx = w.task
                    w.deadline = time.monotonic() + (
                        self.batch_timeout_s if is_batched(spec) else self.timeout_s
                    )
                    items = [(prompts[i], responses[i], answers[i], rows[i]) for i in idx]
                    try:
                        w.conn.send((spec, items))
                    except OSError:  # it died while idle: the sentinel reports it; the task goes back
                        queue.appendleft(w.task)
                        w.task = None
            limits = [w.deadline for w in self._workers if w.task is not None or not w.ready]
            handles = {w.conn: w for w in self._workers} | {w.proc.sentinel: w for w in self._workers}
            timeout = max(0.0, min(limits) - time.monotonic()) if limits else None
            fired = {handles[h] for h in mp_connection.wait(list(handles), timeout=timeout)}
            for w in list(self._workers):
                if w in fired:
                    try:
                        message = w.conn.recv() if w.conn.poll() else None
                    except (EOFError, OSError):
                        message = None
                    if message is None:  # the sentinel fired or the pipe broke: the worker is dead
                        w.proc.join(timeout=10)
                        replace(w, f"crashed (worker exit code {w.proc.exitcode})")
                    elif message == "ready":
                        w.ready = True
                        self._start_failures = 0
                    else:
                        slot, spec, idx = w.task
                        for i, (value, err) in zip(idx, message):
                            if err is not None:
                                errors += 1
                                log.debug("reward %r failed on sample %d: %s", spec, i, err)
                            results[(slot, i)] = value
                        w.task = None
                elif (w.task is not None or not w.ready) and time.monotonic() >= w.deadline:
                    limit = self.start_timeout_s
                    if w.ready:
                        limit = self.batch_timeout_s if is_batched(w.task[1]) else self.timeout_s
                    replace(w, f"timed out after {limit:.1f}s", timeout=w.ready)
        per_fn = {name: [results[(name, i)] for i in range(len(responses))] for name in weights}
        total = [sum(w * per_fn[name][i] for name, w in weights.items()) for i in range(len(responses))]
        return Scores(total=total, per_fn=per_fn, errors=errors, timeouts=timeouts)
