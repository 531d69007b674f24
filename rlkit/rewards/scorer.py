"""Runs reward functions safely: worker processes with a per-call timeout (rlkit/rewards/functions.py has
the contract).

A function that raises, returns a non-number, hangs or kills its process (os._exit, a segfault) yields 0
for that sample and is counted in `reward/errors` (plus `reward/timeouts`); the run never crashes or hangs
because of a reward. This module imports nothing heavy: worker processes load it (spawn) in about a second.
"""

from __future__ import annotations

import itertools
import logging
import multiprocessing as mp
import multiprocessing.connection as mp_connection
import os
import signal
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field

from rlkit import gcpolicy
from rlkit.rewards.functions import call_reward, is_batched, is_correct, resolve
from rlkit.sandbox.containment import (
    ProcessCap,
    cgroup_members,
    default_signals_for_children,
    group_members,
    kill_group,
    limit_this_worker,
    memory_cap_hit,
)
from rlkit.sandbox.protocol import die_with_parent, exit_reason, read_reply, serve_requests
from rlkit.sandbox.reaper import REAPER

log = logging.getLogger(__name__)

_SEQ = itertools.count()  # reward workers' cgroups: a fresh one per worker


def _init_worker(imports: tuple[str, ...]) -> None:
    """Import what the run's reward functions import at their first call (`rlkit_imports`: math's math-verify,
    whose sympy takes a second or two), so that no call spends its time limit importing; a worker for other
    functions skips it."""
    import importlib

    with gcpolicy.setup_phase():
        for module in imports:
            importlib.import_module(module)


def _worker_main(
    conn, parent_pid: int, started_by_main_thread: bool = True, memory_limit_mb: int | None = None,
    cgroup: str | None = None, imports: tuple[str, ...] = (),
) -> None:  # fmt: skip
    """A reward worker: one private pipe to the trainer, no lock shared with any other process.

    It catches and drops SIGINT / SIGTERM: a signal sent to the whole process group (Ctrl-C, `timeout`,
    Slurm, systemd) is the trainer's to handle; the trainer finishes its step with intact rewards and then
    kills its workers (what a function starts gets default dispositions). It exits when the trainer closes
    the pipe and is killed by the kernel when the trainer dies. It leads its own process group, joins its
    pids cgroup, is the OOM killer's first choice and has a memory cap (rlkit/sandbox/containment.py).
    """
    default_signals_for_children()
    die_with_parent(parent_pid, started_by_main_thread=started_by_main_thread)
    limit_this_worker(memory_limit_mb, cgroup)
    _init_worker(imports)
    serve_requests(conn, lambda task: call_reward(*task))


class _Worker:
    """One worker process and its pipe; `task` is the (name, index) it is running, `deadline` its limit."""

    def __init__(
        self,
        ctx,
        start_timeout_s: float,
        memory_limit_mb: int | None = None,
        cap=None,
        imports: tuple[str, ...] = (),
    ):
        import threading

        self.conn, child = ctx.Pipe(duplex=True)
        main = threading.current_thread() is threading.main_thread()
        self.cap = cap
        self.cgroup = cap.cgroup_for(next(_SEQ)) if cap is not None else None
        args = (child, os.getpid(), main, memory_limit_mb, self.cgroup, imports)
        self.proc = ctx.Process(target=_worker_main, args=args, daemon=True)
        self.proc.start()
        REAPER.hold_group(self.proc.pid)  # killed by the reaper if the trainer dies first
        child.close()
        self.ready = False
        self.task: tuple[str, int] | None = None
        self.deadline = time.monotonic() + start_timeout_s  # to start, then per task

    def kill(self) -> None:
        """SIGKILL its process group (the worker and all it started) and reap: never waits on anything the
        worker holds (a stopped or hung worker dies too)."""
        if self.proc.pid is not None:
            kill_group(self.proc.pid, self.cgroup)
        if self.proc.is_alive():
            self.proc.kill()
        self.proc.join(timeout=10)
        REAPER.release_group(self.proc.pid)
        if self.cap is not None:
            self.cap.release(self.cgroup)
        self.conn.close()


@dataclass
class Scores:
    """Rewards of one batch: `total[i]` = fn + sum(weight * extra); `per_fn[name][i]`; error counts."""

    total: list[float]
    per_fn: dict[str, list[float]]
    errors: int
    timeouts: int
    correct: list[float]
    """1.0 where the main reward function's verdict on the sample is correct (see `correct_when`), else 0.0."""
    failed: dict[str, int] = field(default_factory=dict)
    """Per function slot (`per_fn`'s keys): the samples its call failed on (raised, a bad value, a timeout,
    a crash), each scored 0."""
    first_error: dict[str, str] = field(default_factory=dict)
    """Per function slot that failed: the first failure's description."""


@dataclass
class _Tally:
    """One `score` call's results by (slot, sample) and its failures."""

    results: dict = field(default_factory=dict)
    errors: int = 0
    timeouts: int = 0
    failed: dict = field(default_factory=dict)
    first_error: dict = field(default_factory=dict)

    def fail(self, slot: str, idx, why: str, *, timeout: bool = False) -> None:
        """Samples `idx` of `slot` score 0, counted (in `timeouts` too when `timeout`)."""
        for i in idx:
            self.results[(slot, i)] = 0.0
        self.errors += len(idx)
        self.timeouts += timeout * len(idx)
        self.failed[slot] = self.failed.get(slot, 0) + len(idx)
        self.first_error.setdefault(slot, why)

    def record(self, task: tuple, message: list) -> None:
        """A worker's answer to `task` (slot, function, sample indices): (value, error or None) per sample."""
        slot, spec, idx = task
        for i, (value, err) in zip(idx, message):
            if err is not None:
                self.fail(slot, (i,), err)
                log.debug("reward %r failed on sample %d: %s", spec, i, err)
            self.results[(slot, i)] = value


class RewardScorer:
    """Scores samples with a weighted sum of reward functions (see the module doc for the contract).

    Args:
        fn: main reward (weight 1).
        extra: more reward functions and their weights.
        timeout_s: per-call limit; a call over it is abandoned (its worker killed) and scores 0.
        num_workers: worker processes.
        correct_threshold: the main reward at or above which a sample is correct, for functions that
            declare no verdict of their own (`correct_when`).
        route_by: a dataset column whose value picks each sample's main reward from `routes`
            (`fn` for values not listed); None = `fn` for every sample.
        routes: column value -> reward function.
        batch_timeout_s: the limit of one call of a batched function.
        memory_limit_mb: each worker process's memory cap (RLIMIT_DATA, MiB); None = no cap.
        max_processes: the processes and threads of all workers and what they start together (a pids
            cgroup, where one is writable); None = no cap (the cgroup still finds what left a group).
    """

    def __init__(
        self,
        fn: str,
        extra: dict[str, float] | None = None,
        *,
        timeout_s: float = 10.0,
        num_workers: int = 2,
        correct_threshold: float = 1.0,
        route_by: str | None = None,
        routes: dict[str, str] | None = None,
        batch_timeout_s: float = 60.0,
        memory_limit_mb: int | None = None,
        max_processes: int | None = None,
    ):
        self.main = fn
        self.weights: dict[str, float] = {fn: 1.0}
        for name, w in (extra or {}).items():
            self.weights[name] = self.weights.get(name, 0.0) + float(w)
        self.correct_threshold = correct_threshold
        self.route_by, self.routes = route_by, dict(routes or {})
        # resolve: fail at start-up on a bad name, not in a worker
        functions = [resolve(name) for name in [*self.weights, *self.routes.values()]]
        self._imports = tuple(sorted({m for fn in functions for m in getattr(fn, "rlkit_imports", ())}))
        self.timeout_s = timeout_s
        self.batch_timeout_s = batch_timeout_s
        self.num_workers = num_workers
        self.memory_limit_mb = memory_limit_mb
        self.max_processes = max_processes
        self._cap: ProcessCap | None = None  # made with the first worker
        self.start_timeout_s = max(120.0, timeout_s)
        self._workers: list[_Worker] = []
        self._start_failures = 0
        self._ctx = mp.get_context("spawn")  # no fork of a process holding torch threads / CUDA

    def _spawn(self) -> _Worker:
        if self._cap is None:
            self._cap = ProcessCap(self.max_processes)
        return _Worker(self._ctx, self.start_timeout_s, self.memory_limit_mb, self._cap, self._imports)

    def close(self) -> None:
        """Kill the workers (they are stateless); safe to call twice, never blocks on a worker."""
        workers, self._workers = self._workers, []
        for w in workers:
            w.kill()
        cap, self._cap = self._cap, None
        if cap is not None:
            cap.close()

    def spec_for(self, row: dict) -> str:
        """The main reward function of a sample with dataset columns `row` (its route, or `fn`)."""
        return self._spec(self.main, row)

    def _kill_leftovers(self) -> None:
        """End of a batch: kill what the reward functions started and left running (the processes of each
        worker's group and pids cgroup other than the worker itself)."""
        workers = {w.proc.pid: w for w in self._workers if w.proc.pid is not None}
        for _ in range(3):  # one may fork while they are killed
            groups = group_members(set(workers))
            left = {p for pid, w in workers.items() for p in [*groups[pid], *cgroup_members(w.cgroup)]}
            left -= set(workers)
            if not left:
                return
            for pid in left:
                try:
                    os.kill(pid, signal.SIGKILL)
                except OSError:
                    pass

    def _spec(self, slot: str, row: dict) -> str:
        """The function that scores `slot` for a sample: the main slot follows the sample's route."""
        if slot != self.main or self.route_by is None:
            return slot
        if self.route_by not in row:
            raise KeyError(f"reward.route_by={self.route_by!r} is not a column of the dataset: {sorted(row)}")
        return self.routes.get(str(row[self.route_by]), slot)

    def _tasks(
        self, weights: dict[str, float], rows: Sequence[dict]
    ) -> list[tuple[str, str, tuple[int, ...]]]:
        """(slot, function, sample indices) calls: per sample, or one per slot and route when batched."""
        tasks = []
        for slot in weights:
            by_spec: dict[str, list[int]] = {}
            for i, row in enumerate(rows):
                by_spec.setdefault(self._spec(slot, row), []).append(i)
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
        tally = _Tally()
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
                    message = read_reply(w.conn)
                    if message is None:  # the sentinel fired or the pipe broke: the worker is dead
                        w.proc.join(timeout=10)
                        self._replace(w, self._death(w), tally)
                    elif message == "ready":
                        w.ready = True
                        self._start_failures = 0
                    else:
                        tally.record(w.task, message)
                        w.task = None
                elif (w.task is not None or not w.ready) and time.monotonic() >= w.deadline:
                    limit = self.start_timeout_s
                    if w.ready:
                        limit = self.batch_timeout_s if is_batched(w.task[1]) else self.timeout_s
                    self._replace(w, f"timed out after {limit:.1f}s", tally, timeout=w.ready)
        self._kill_leftovers()
        return self._scores(tally, weights, rows, len(responses))

    def _death(self, w: _Worker) -> str:
        """Why worker `w` died, in words (its memory cgroup's kill named as such)."""
        if memory_cap_hit(w.cgroup):
            return (
                f"crashed (its memory, the worker and all it started, passed "
                f"reward.memory_limit_mb={self.memory_limit_mb}: killed by its memory cgroup)"
            )
        return f"crashed (worker {exit_reason(w.proc.exitcode)})"

    def _replace(self, w: _Worker, why: str, tally: _Tally, *, timeout: bool = False) -> None:
        """Kill worker `w` (its task scores 0, counted) and start another in its place."""
        if w.task is not None:
            slot, spec, idx = w.task
            log.warning("reward %r %s on sample(s) %s: scored 0", spec, why, list(idx))
            tally.fail(slot, idx, why, timeout=timeout)
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

    def _scores(self, tally: _Tally, weights: dict[str, float], rows: Sequence[dict], n: int) -> Scores:
        per_fn = {name: [tally.results[(name, i)] for i in range(n)] for name in weights}
        total = [sum(w * per_fn[name][i] for name, w in weights.items()) for i in range(n)]
        correct = [0.0] * n
        if self.main in per_fn:
            correct = [
                float(is_correct(self._spec(self.main, rows[i]), v, self.correct_threshold))
                for i, v in enumerate(per_fn[self.main])
            ]
        return Scores(
            total=total, per_fn=per_fn, errors=tally.errors, timeouts=tally.timeouts, correct=correct,
            failed=tally.failed, first_error=tally.first_error,
        )  # fmt: skip
