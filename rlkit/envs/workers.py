"""Environments in worker processes, where a call that hangs or crashes can be killed (rlkit.rollout.episodes
drives them).

An environment is stateful and lives for one episode, so a worker owns the environment objects it built
(`make`) for the whole episode batch, addressed by id, and runs their `reset` and `step` calls one at a
time: one worker per episode (up to `MAX_WORKERS` per batch, beyond which the episodes of a row share one). Each call gets `env.timeout_s` from the moment it is sent to its worker (start-up is not charged to
it). A call over its limit, or a worker that dies (os._exit, a segfault, the OOM killer), gets its worker's
whole process group (and pids cgroup) SIGKILLed and reaped: no thread or process it started outlives it,
and a call that spins on the CPU cannot hold the trainer's GIL. Any other environment that lived in that worker is lost with it, so its episode ends too
(counted as an error, with the reason). Workers fork from multiprocessing's fork server (never from the
trainer, which holds torch threads and maybe CUDA), catch and drop SIGINT / SIGTERM (the trainer's to
handle; what they start gets default dispositions), die with the fork server (PR_SET_PDEATHSIG), which
ignores SIGTERM too and exits with the trainer, and are closed at the end of the batch, their process groups
killed. Their process groups and cgroups are held by the trainer's reaper (rlkit/sandbox/reaper.py), which
kills them if the trainer dies first.

Containment (`Limits`, rlkit/sandbox/containment.py): each worker leads its own session, has
oom_score_adj 1000 and a memory cap (`env.memory_limit_mb`, RLIMIT_DATA: an allocation over it is a
MemoryError that fails the episode with its reason); the batch's workers and all they start are capped at
`env.max_processes` (a pids cgroup, else a count in /proc every `POLL_S`); each worker's stdout and stderr,
its children's included, are cut at `MAX_OUTPUT_BYTES`. `build_once` builds the environment in a worker at
start-up, so an __init__ that raises, exits or hangs is a start-up error.

Every result is checked in the worker (`check_messages`, `check_step`): a malformed one is an error of
that call, never an exception in the trainer. `LocalEnvs` runs the same calls in this process, without
a thread or a timeout: only for `single_turn`, whose calls cannot hang.
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import multiprocessing.connection as mp_connection
import multiprocessing.spawn as mp_spawn
import os
import pickle
import time
from collections import deque
from dataclasses import dataclass

from rlkit.envs.base import check_messages, check_step, make_env, resolve_env
from rlkit.envs.images import PictureRule, text_chars
from rlkit.rewards.functions import describe
from rlkit.sandbox.containment import (
    ProcessCap,
    bound_output,
    default_signals_for_children,
    kill_group,
    limit_this_worker,
    memory_cap_hit,
    over_shared_memory,
)
from rlkit.sandbox.protocol import die_with_parent, exit_reason, read_reply, serve_requests
from rlkit.sandbox.reaper import REAPER

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class EnvCall:
    """One call to an environment in its worker: `make` (build it), `reset(row, messages)`, `step(text)` or
    `rows` (the class's dataset). `max_chars` (step): the most characters of an observation that the
    episode's token budget could hold; a longer one is not sent back (`Oversized`). `pictures` (step): how the
    observation's images are decoded (rlkit.envs.images; None: the run takes no images)."""

    env: int
    method: str
    args: tuple = ()
    max_chars: int | None = None
    pictures: PictureRule | None = None


@dataclass(frozen=True)
class Oversized:
    """In a step's reply, in place of an observation longer than `EnvCall.max_chars`: its size only."""

    chars: int


@dataclass(frozen=True)
class EnvReply:
    """A call's result. `value`: make -> the stop strings; reset -> messages; step -> (obs, reward, done);
    the error's text when not `ok`. `tool_calls`: the environment's counter after the call."""

    env: int
    ok: bool
    value: object
    tool_calls: int = 0


def _checked_first_messages(out) -> list[dict]:
    messages = check_messages(out, "reset's first messages")
    if not messages:
        raise ValueError("reset's first messages are empty")
    return messages


def _checked_rows(out) -> list[dict]:
    if not isinstance(out, (list, tuple)):
        raise TypeError(f"rows must return a list of dicts, got {describe(out)}")
    for k, row in enumerate(out):
        if not isinstance(row, dict):
            raise TypeError(f"rows()[{k}] must be a dict, got {type(row).__name__}")
    return [dict(row) for row in out]


def _bounded(step: tuple, max_chars: int | None) -> tuple:
    """A checked step result with an observation over `max_chars` characters replaced by `Oversized`: it could
    never fit the episode's budget, so it is refused here, before it crosses the pipe or meets the tokenizer."""
    obs, reward, done = step
    if obs is None or max_chars is None:
        return step
    chars = sum(text_chars(m["content"]) + len(m["role"]) for m in obs)
    return (Oversized(chars) if chars > max_chars else obs), reward, done


def serve(envs: dict, call: EnvCall, spec: str, kwargs: dict) -> EnvReply:
    """Run one call on the environments `envs` (id -> object); any failure is the reply's error. `rows` calls
    the environment class's dataset (`rows(**kwargs)`, data.path=env) and builds no environment."""
    try:
        if call.method == "make":
            envs[call.env] = make_env(spec, kwargs)
            out = getattr(envs[call.env], "stop", ())
        elif call.method == "rows":
            out = resolve_env(spec).rows(**kwargs)
        else:
            out = getattr(envs[call.env], call.method)(*call.args)
    except MemoryError:
        envs.pop(call.env, None)  # free what it holds, if nothing else does
        why = f"{call.method} ran out of memory (MemoryError: over the worker's cap, env.memory_limit_mb)"
        return EnvReply(call.env, False, why)
    except BaseException as e:  # an environment must never take the run down (SystemExit included)
        return EnvReply(call.env, False, f"{call.method} raised {type(e).__name__}: {e}"[:500])
    try:
        if call.method == "make":
            value = tuple(str(s) for s in out)
        elif call.method == "rows":
            value = _checked_rows(out)
        elif call.method == "reset":
            value = _checked_first_messages(out)
        else:
            value = _bounded(check_step(out, call.pictures), call.max_chars)
        reply = EnvReply(call.env, True, value, int(getattr(envs.get(call.env), "tool_calls", 0)))
        pickle.dumps(reply)  # an unpicklable value fails this call here, not the pipe
        return reply
    except BaseException as e:
        return EnvReply(call.env, False, f"{call.method} returned a bad result: {e}"[:500])


MAX_OUTPUT_BYTES = 64 << 10
"""What one environment worker (one episode, or the episodes of a row sharing a worker) and everything it
starts may write to stdout / stderr in a batch; the rest is dropped, with one line saying so."""


@dataclass(frozen=True)
class Limits:
    """What contains a batch's environment workers (rlkit/sandbox/containment.py): each process's memory
    cap (MiB, RLIMIT_DATA), the batch's process cap, the output cap per worker. None = no cap."""

    memory_limit_mb: int | None = 8192
    max_processes: int | None = 8192
    max_output_bytes: int = MAX_OUTPUT_BYTES


DEFAULT_LIMITS = Limits()


def _worker_main(conn, spec: str, kwargs: dict, limits: Limits, cgroup: str | None) -> None:
    default_signals_for_children()  # SIGINT / SIGTERM caught and dropped, SIGQUIT default
    die_with_parent(os.getppid())  # the fork server, which exits when the trainer does
    limit_this_worker(limits.memory_limit_mb, cgroup)
    bound_output(limits.max_output_bytes, f"environment {spec}")
    envs: dict = {}
    serve_requests(conn, lambda call: serve(envs, call, spec, kwargs))


class _Worker:
    def __init__(self, ctx, spec: str, kwargs: dict, start_timeout_s: float, limits: Limits, cgroup):
        self.conn, child = ctx.Pipe(duplex=True)
        self.cgroup = cgroup
        self.proc = ctx.Process(target=_worker_main, args=(child, spec, kwargs, limits, cgroup), daemon=True)
        self.proc.start()
        REAPER.hold_group(self.proc.pid)  # killed by the reaper if the trainer dies first
        child.close()
        self.ready = False
        self.busy: EnvCall | None = None
        self.deadline = time.monotonic() + start_timeout_s
        self.queue: deque[EnvCall] = deque()

    def kill(self) -> None:
        """SIGKILL its whole process group (and its cgroup) and reap (never waits on anything it holds)."""
        kill_group(self.proc.pid, self.cgroup)
        if self.proc.is_alive():
            self.proc.kill()
        self.proc.join(timeout=10)
        REAPER.release_group(self.proc.pid)
        self.conn.close()


POLL_S = 0.2
"""How often, while a call runs, the shared memory of a batch's processes is read (`env.memory_limit_mb`:
RLIMIT_DATA does not count it), and their processes counted where no pids cgroup caps them (ProcessCap's
fallback)."""

MAX_WORKERS = 64
"""Worker processes of one batch: one per episode up to this many (beyond it, neighbours share one)."""


def context(preload: tuple[str, ...] = ()):
    """Workers fork from multiprocessing's fork server (started once, clean: no torch, no CUDA, no trainer
    threads; it preloads this module and ignores SIGTERM), so a batch's workers start in milliseconds; spawn
    where there is no fork server. `preload`: the environment's heavy modules (`Environment.preload`), imported
    by the fork server when this call starts it (one already running keeps what it has)."""
    if "forkserver" not in mp.get_all_start_methods():
        return mp.get_context("spawn")
    ctx = mp.get_context("forkserver")
    # rlkit.envs.forkserver makes the fork server ignore SIGTERM (see there) when started by this process,
    # and take this process's main module as already run, so that no worker runs it again.
    os.environ["RLKIT_ENV_FORKSERVER_PARENT"] = str(os.getpid())
    prepared = mp_spawn.get_preparation_data("rlkit-env-worker")
    os.environ["RLKIT_ENV_MAIN_NAME"] = prepared.get("init_main_from_name", "")
    os.environ["RLKIT_ENV_MAIN_PATH"] = prepared.get("init_main_from_path", "")
    ctx.set_forkserver_preload(["rlkit.envs.forkserver", *preload])
    return ctx


class EnvWorkers:
    """`count` environments of `spec` (ids 0 .. count-1), built in worker processes (see the module doc).

    `call(method, {id: args})` returns {id: (status, value)}: ("ok", value), ("error", why) or
    ("timeout", why). An environment lost with its worker answers every later call with ("error", why).
    """

    def __init__(
        self,
        spec: str,
        kwargs: dict,
        count: int,
        *,
        timeout_s: float,
        max_workers: int = MAX_WORKERS,
        limits: Limits = DEFAULT_LIMITS,
        timeout_key: str = "env.timeout_s",
    ):
        self.timeout_s, self.timeout_key = timeout_s, timeout_key
        self.start_timeout_s = max(60.0, timeout_s)
        self.limits = limits
        ctx = context(tuple(getattr(resolve_env(spec), "preload", ())))
        n = max(1, min(count, max_workers))
        self._cap = ProcessCap(limits.max_processes)
        self._workers = [
            _Worker(ctx, spec, dict(kwargs), self.start_timeout_s, limits, self._cap.cgroup_for(k))
            for k in range(n)
        ]
        # Neighbours share a worker when there are more episodes than workers: the G episodes of a row.
        self._home = {i: self._workers[i * n // count] for i in range(count)}
        self.lost: dict[int, str] = {}
        self.tool_calls = [0] * count

    def close(self) -> None:
        """Stop every worker (asked, then its process group killed: nothing it started survives the batch);
        safe to call twice."""
        workers, self._workers = self._workers, []
        for w in workers:
            try:
                w.conn.send(None)
            except OSError:
                pass
        for w in workers:
            w.proc.join(timeout=1.0)
            w.kill()
        self._cap.close()

    def _lose(self, w: _Worker, why: str, results: dict) -> None:
        """Kill `w`; its busy call gets `why`, its other environments are lost (their queued calls fail)."""
        w.kill()
        self._workers.remove(w)
        if w.busy is not None and w.busy.env not in results:
            results[w.busy.env] = ("error", why)
        culprit = w.busy.env if w.busy is not None else None
        shared = why if culprit is None else f"lost with its worker ({why} in environment {culprit})"
        for env, home in self._home.items():
            if home is w and env not in self.lost:
                self.lost[env] = why if env == culprit else shared
        for call in w.queue:
            results[call.env] = ("error", self.lost[call.env])
        w.busy, w.queue = None, deque()

    def _dispatch(self) -> None:
        for w in self._workers:
            if w.ready and w.busy is None and w.queue:
                w.busy = w.queue.popleft()
                w.deadline = time.monotonic() + self.timeout_s
                try:
                    w.conn.send(w.busy)
                except OSError:  # it died: its sentinel reports it
                    pass

    def _receive(self, w: _Worker, results: dict) -> None:
        message = read_reply(w.conn)
        if message is None:  # the sentinel fired or the pipe broke: the worker is dead
            w.proc.join(timeout=10)
            if memory_cap_hit(w.cgroup):
                cap = self.limits.memory_limit_mb
                why = f"its memory (the worker and all it started) passed env.memory_limit_mb={cap}"
                self._lose(w, f"{why} (killed by its memory cgroup)", results)
            else:
                self._lose(w, f"its worker died ({exit_reason(w.proc.exitcode)})", results)
        elif message == "ready":
            w.ready = True
        else:
            self.tool_calls[message.env] = message.tool_calls
            results[message.env] = ("ok", message.value) if message.ok else ("error", message.value)
            w.busy = None

    def call(
        self, method: str, args: dict[int, tuple], max_chars: dict[int, int] | None = None,
        pictures: PictureRule | None = None,
    ) -> dict[int, tuple[str, object]]:  # fmt: skip
        results: dict[int, tuple[str, object]] = {}
        for env, a in args.items():
            if env in self.lost:
                results[env] = ("error", self.lost[env])
            else:
                bound = (max_chars or {}).get(env)
                self._home[env].queue.append(EnvCall(env, method, tuple(a), bound, pictures))
        while any(w.queue or w.busy is not None for w in self._workers):
            self._dispatch()
            limits = [w.deadline for w in self._workers if w.busy is not None or not w.ready]
            handles = {w.conn: w for w in self._workers} | {w.proc.sentinel: w for w in self._workers}
            timeout = max(0.0, min(limits) - time.monotonic()) if limits else None
            # Polled a few times a second: the workers' processes where no pids cgroup caps them, and the
            # shared memory RLIMIT_DATA does not count.
            if self._cap.counting or self.limits.memory_limit_mb is not None:
                timeout = POLL_S if timeout is None else min(timeout, POLL_S)
            fired = {handles[h] for h in mp_connection.wait(list(handles), timeout=timeout)}
            hog = self._cap.over_cap([w.proc.pid for w in self._workers])
            shm_pid, shm_mib = over_shared_memory(
                {w.proc.pid: w.cgroup for w in self._workers}, self.limits.memory_limit_mb
            ) or (None, 0)
            for w in list(self._workers):
                if w.proc.pid == hog:
                    cap = self.limits.max_processes
                    self._lose(w, f"its processes passed env.max_processes={cap} (worker killed)", results)
                elif w.proc.pid == shm_pid:
                    cap = self.limits.memory_limit_mb
                    why = (
                        f"its shared memory ({shm_mib} MiB) passed env.memory_limit_mb={cap} (worker killed)"
                    )
                    self._lose(w, why, results)
                elif w in fired:
                    self._receive(w, results)
                elif w.busy is not None and time.monotonic() >= w.deadline:
                    over = f"{method} ran over {self.timeout_key}={self.timeout_s:g}s"
                    results[w.busy.env] = ("timeout", over)
                    self._lose(w, f"{over} (worker killed)", results)
                elif not w.ready and time.monotonic() >= w.deadline:
                    self._lose(w, f"its worker did not start within {self.start_timeout_s:g}s", results)
        return results


def limits_of(env) -> Limits:
    """The Limits of an `env.*` config (EnvConfig)."""
    return Limits(memory_limit_mb=env.memory_limit_mb, max_processes=env.max_processes)


def build_once(spec: str, kwargs: dict, *, timeout_s: float, limits: Limits) -> None:
    """Build one environment in a worker, as an episode would (the start-up check): an __init__ that raises,
    exits or runs over `timeout_s` raises ValueError naming env.name and why; the trainer is untouched."""
    workers = EnvWorkers(spec, kwargs, 1, timeout_s=timeout_s, limits=limits)
    try:
        status, why = workers.call("make", {0: ()})[0]
    finally:
        workers.close()
    if status != "ok":
        raise ValueError(
            f"env.name={spec!r} cannot be built with env.kwargs={dict(kwargs)} in a worker: {why}"
        )


def rows_in_worker(spec: str, kwargs: dict, *, timeout_s: float, limits: Limits) -> list[dict]:
    """The dataset of `data.path=env` (the environment class's `rows(**kwargs)`), read in a worker as every
    other call of an environment is: rows that raise, exit or run over `timeout_s` raise ValueError naming
    env.name and why; the trainer is untouched."""
    workers = EnvWorkers(
        spec, kwargs, 1, timeout_s=timeout_s, limits=limits, timeout_key="env.startup_timeout_s"
    )
    try:
        status, value = workers.call("rows", {0: ()})[0]
    finally:
        workers.close()
    if status != "ok":
        raise ValueError(
            f"data.path=env: the dataset of env.name={spec!r} (its rows(**env.kwargs), env.kwargs="
            f"{dict(kwargs)}) cannot be read in a worker: {value}"
        )
    return value


class LocalEnvs:
    """The same calls in this process, without a thread or a timeout: for `single_turn` only (it never hangs)."""

    def __init__(self, spec: str, kwargs: dict, count: int):
        self.spec, self.kwargs = spec, dict(kwargs)
        self._envs: dict = {}
        self.lost: dict[int, str] = {}
        self.tool_calls = [0] * count

    def call(
        self, method: str, args: dict[int, tuple], max_chars: dict[int, int] | None = None,
        pictures: PictureRule | None = None,
    ) -> dict[int, tuple[str, object]]:  # fmt: skip
        results = {}
        for env, a in args.items():
            call = EnvCall(env, method, tuple(a), (max_chars or {}).get(env), pictures)
            reply = serve(self._envs, call, self.spec, self.kwargs)
            self.tool_calls[env] = reply.tool_calls
            results[env] = ("ok", reply.value) if reply.ok else ("error", reply.value)
        return results

    def close(self) -> None:
        self._envs.clear()
