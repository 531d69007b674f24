"""Reward functions and their safe execution.

A reward function is `fn(prompt: str, response: str, answer: str) -> float`. Built-ins are registered by
name (`math`, `format`); any other function is addressed by import path (`my_module:my_fn` or
`my_module.my_fn`). Functions run in worker processes with a per-call timeout: one that raises, returns
a non-number, hangs or kills its process (os._exit, a segfault) yields 0 for that sample and is counted
in `reward/errors` (plus `reward/timeouts`); the run never crashes or hangs because of a reward.

This module imports nothing heavy at import time: worker processes load it (spawn) in about a second.
"""

from __future__ import annotations

import functools
import importlib
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

    def score(
        self,
        prompts: Sequence[str],
        responses: Sequence[str],
        answers: Sequence[str],
        *,
        only: Sequence[str] | None = None,
    ) -> Scores:
        """Score N samples (with the functions in `only`, default all).

        Each call runs on an idle worker and gets `timeout_s` from the moment it is sent there (worker
        start-up is not charged to it). A call over its limit scores 0 and its worker is killed and
        replaced; a worker that dies (crash, segfault, OOM killer, kill -9) is seen at once through its
        process sentinel, and its call scores 0 and counts in `errors`. Workers share no lock or queue, so
        a dead worker can never block the others or `close()`.
        """
        weights = {k: w for k, w in self.weights.items() if only is None or k in only}
        queue = deque((name, i) for name in weights for i in range(len(responses)))
        results: dict[tuple[str, int], float] = {}
        errors = timeouts = 0

        def replace(w: _Worker, why: str, *, timeout: bool = False) -> None:
            nonlocal errors, timeouts
            if w.task is not None:
                log.warning("reward %r %s on sample %d: scored 0", w.task[0], why, w.task[1])
                results[w.task] = 0.0
                errors += 1
                timeouts += timeout
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
                    w.deadline = time.monotonic() + self.timeout_s
                    name, i = w.task
                    try:
                        w.conn.send((name, prompts[i], responses[i], answers[i]))
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
                        value, err = message
                        if err is not None:
                            errors += 1
                            log.debug("reward %r failed on sample %d: %s", w.task[0], w.task[1], err)
                        results[w.task] = value
                        w.task = None
                elif (w.task is not None or not w.ready) and time.monotonic() >= w.deadline:
                    limit = self.timeout_s if w.ready else self.start_timeout_s
                    replace(w, f"timed out after {limit:.1f}s", timeout=w.ready)
        per_fn = {name: [results[(name, i)] for i in range(len(responses))] for name in weights}
        total = [sum(w * per_fn[name][i] for name, w in weights.items()) for i in range(len(responses))]
        return Scores(total=total, per_fn=per_fn, errors=errors, timeouts=timeouts)
