"""Containment of worker processes (reward workers, rlkit/rewards/scorer.py; environment workers,
rlkit/envs/workers.py): whatever a reward function or an environment does, it stays inside its worker.

In the worker, at start (`limit_this_worker`):
- it leads its own session (`os.setsid`), so it and everything it starts form one process group, killed
  as a whole (`os.killpg`) on a timeout, a crash and at the end of the batch;
- `oom_score_adj` 1000: under memory pressure the kernel's OOM killer takes workers before the trainer;
- a memory cap, `RLIMIT_DATA` (the private writable memory of a process: heap, anonymous mappings,
  thread stacks; not shared libraries or files). It works unprivileged everywhere and turns a hog into a
  `MemoryError` in the call that allocates, failing that episode (or sample) with the reason, while the
  trainer is untouched. It is per process: each process a worker starts gets the same cap.
- it joins its pids cgroup, when there is one (below).

From the trainer (`ProcessCap`): a cap on the processes (and threads) of a batch's workers and all they
start, so a fork loop cannot exhaust the machine's pids (the trainer's next fork or thread would fail).
Root ignores RLIMIT_NPROC, so the cap is a pids cgroup (`pids.max`; cgroup v1 `/sys/fs/cgroup/pids`, or
cgroup v2 where the pids controller is enabled) with one child cgroup per worker, so a killed worker's
processes are found even when they left its process group (`setsid`). Where no pids cgroup is writable
(an unprivileged container), the fallback counts the workers' process groups in /proc on every poll
(`over_cap`) and the caller kills the largest group over the cap: that bounds a slow fork loop, and a
process that leaves its group escapes it.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import os
import resource
import signal
import threading
import time

log = logging.getLogger(__name__)

_SEQ = itertools.count()


def limit_this_worker(memory_limit_mb: int | None, cgroup: str | None) -> None:
    """In a fresh worker process: new session, OOM-killer preference, memory cap, its pids cgroup."""
    if cgroup is not None:
        with contextlib.suppress(OSError):  # before anything forks, so every child is in it
            with open(os.path.join(cgroup, "cgroup.procs"), "w") as f:
                f.write(str(os.getpid()))
    with contextlib.suppress(OSError):
        os.setsid()
    with contextlib.suppress(OSError):
        with open("/proc/self/oom_score_adj", "w") as f:
            f.write("1000")
    if memory_limit_mb is not None:
        limit = int(memory_limit_mb) << 20
        resource.setrlimit(resource.RLIMIT_DATA, (limit, limit))


def bound_output(max_bytes: int, what: str) -> None:
    """Route this process's stdout and stderr (fds 1 and 2, inherited by everything it starts) through
    pipes that forward at most `max_bytes` in all to where they went before; the rest is dropped, with
    one line saying so."""
    left = [max_bytes]
    lock = threading.Lock()

    def forward(read_fd: int, out_fd: int) -> None:
        while chunk := os.read(read_fd, 1 << 16):
            with lock:
                keep, left[0] = chunk[: max(left[0], 0)], left[0] - len(chunk)
                dropped_now = left[0] < 0 and left[0] + len(chunk) >= 0
            with contextlib.suppress(OSError):
                if keep:
                    os.write(out_fd, keep)
                if dropped_now:
                    os.write(
                        out_fd,
                        f"\n[rlkit] {what} (pid {os.getpid()}) wrote more than {max_bytes} bytes to "
                        "stdout/stderr: the rest is dropped\n".encode(),
                    )

    for fd in (1, 2):
        original = os.dup(fd)
        read_fd, write_fd = os.pipe()
        os.dup2(write_fd, fd)
        os.close(write_fd)
        threading.Thread(target=forward, args=(read_fd, original), daemon=True, name=f"rlkit-out{fd}").start()


def group_members(pgids: set[int]) -> dict[int, list[int]]:
    """The live processes of each process group in `pgids` (from /proc), zombies left out."""
    members: dict[int, list[int]] = {g: [] for g in pgids}
    if not os.path.isdir("/proc"):  # not Linux: the process groups are still killed as a whole
        return members
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        if fields[0] != "Z" and int(fields[2]) in members:  # state, ppid, pgrp
            members[int(fields[2])].append(int(name))
    return members


def _pids_cgroup_roots() -> list[str]:
    """Where this process's pids cgroup lives: cgroup v1's pids hierarchy, else cgroup v2's."""
    roots = []
    try:
        with open("/proc/self/cgroup") as f:
            lines = [line.rstrip("\n").split(":", 2) for line in f]
    except OSError:
        return roots
    for _, controllers, path in lines:
        if "pids" in controllers.split(","):
            roots.append("/sys/fs/cgroup/pids" + path)
    for hierarchy, _, path in lines:
        if hierarchy == "0":
            roots += ["/sys/fs/cgroup" + path, "/sys/fs/cgroup/unified" + path]
    return [r.rstrip("/") for r in roots]


def _kill_cgroup(path: str, budget_s: float = 2.0) -> None:
    """SIGKILL every process in cgroup `path` until it is empty (new forks are refused first)."""
    with contextlib.suppress(OSError):
        with open(os.path.join(path, "pids.max"), "w") as f:
            f.write("0")
    end = time.monotonic() + budget_s
    while time.monotonic() < end:
        try:
            with open(os.path.join(path, "cgroup.procs")) as f:
                pids = [int(p) for p in f.read().split()]
        except OSError:
            return
        if not pids:
            return
        for pid in pids:
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)
        time.sleep(0.01)


def kill_group(pid: int, cgroup: str | None) -> None:
    """SIGKILL worker `pid`'s process group (it leads it) and whatever is left in its cgroup."""
    with contextlib.suppress(OSError):
        os.killpg(pid, signal.SIGKILL)
    if cgroup is not None:
        _kill_cgroup(cgroup)


class ProcessCap:
    """At most `max_processes` processes and threads in the workers of one batch (or one scorer) and all
    they start (see the module doc). `cgroup_for(k)` is worker k's cgroup (None in the fallback)."""

    def __init__(self, max_processes: int | None):
        self.max_processes = max_processes
        self.path: str | None = None
        if max_processes is None:
            return
        name = f"rlkit-{os.getpid()}-{next(_SEQ)}"
        for root in _pids_cgroup_roots():
            path = os.path.join(root, name)
            try:
                os.mkdir(path)
            except OSError:
                continue
            try:
                with open(os.path.join(path, "pids.max"), "w") as f:
                    f.write(str(max_processes))
                self.path = path
                return
            except OSError:
                with contextlib.suppress(OSError):
                    os.rmdir(path)

    def cgroup_for(self, k: int) -> str | None:
        if self.path is None:
            return None
        path = os.path.join(self.path, f"w{k}")
        try:
            os.mkdir(path)
        except FileExistsError:
            pass
        except OSError:
            return None
        return path

    @property
    def counting(self) -> bool:
        """True when the cap is the fallback's count in /proc (the caller polls `over_cap`)."""
        return self.path is None and self.max_processes is not None

    def over_cap(self, leaders: list[int]) -> int | None:
        """Fallback only (no cgroup): the leader of the largest process group when the groups of `leaders`
        hold more than `max_processes` processes together, else None."""
        if not self.counting or not leaders:
            return None
        members = group_members(set(leaders))
        if sum(map(len, members.values())) <= self.max_processes:
            return None
        return max(members, key=lambda g: len(members[g]))

    def close(self) -> None:
        """Kill whatever is still in the cgroups and remove them; safe to call twice."""
        if self.path is None:
            return
        path, self.path = self.path, None
        with contextlib.suppress(OSError):
            for sub in os.listdir(path):
                if os.path.isdir(os.path.join(path, sub)):
                    _kill_cgroup(os.path.join(path, sub))
                    _rmdir(os.path.join(path, sub))
        _kill_cgroup(path)
        _rmdir(path)


def _rmdir(path: str, budget_s: float = 2.0) -> None:
    end = time.monotonic() + budget_s
    while True:
        try:
            os.rmdir(path)
            return
        except FileNotFoundError:
            return
        except OSError as e:
            if time.monotonic() >= end:
                log.debug("cannot remove cgroup %s: %s", path, e)
                return
            time.sleep(0.01)
