"""Containment of worker processes (reward workers, rlkit/rewards/scorer.py; environment workers,
rlkit/envs/workers.py): whatever a reward function or an environment does, it stays inside its worker.

In the worker, at start (`limit_this_worker`):
- it leads its own session (`os.setsid`), so it and everything it starts form one process group, killed
  as a whole (`os.killpg`) on a timeout, a crash and at the end of the batch;
- `oom_score_adj` 1000: under memory pressure the kernel's OOM killer takes workers before the trainer;
- a memory cap, `RLIMIT_DATA` (the private writable memory of a process: heap, anonymous mappings,
  thread stacks; not shared libraries or files), on top of what the worker holds at its start. It works
  unprivileged everywhere and turns a hog into a `MemoryError` in the call that allocates, failing that
  episode (or sample) with the reason, while the trainer is untouched. It is per process: each process a
  worker starts gets the same cap.
- it joins its pids cgroup, when there is one (below).

From the trainer (`ProcessCap`): a cap on the processes (and threads) of a batch's workers and all they
start, so a fork loop cannot exhaust the machine's pids (the trainer's next fork or thread would fail).
Root ignores RLIMIT_NPROC, so the cap is a pids cgroup (`pids.max`; a mounted cgroup v1 hierarchy with the
pids controller, or cgroup2 where it offers pids: the mounts' fs types and options are read from
/proc/self/mountinfo, `_pids_cgroup_roots`) with one child cgroup per worker, so a killed worker's
processes are found even when they left its process group (`setsid`). Where no pids cgroup can be made
(an unprivileged container; logged once) the fallback counts the workers' process groups in /proc on every poll
(`over_cap`) and the caller kills the largest group over the cap: that bounds a slow fork loop, and a
process that leaves its group escapes it. A pids cgroup is made even without a cap (`pids.max` "max"), to
find the processes that left a worker's group.

What outlives the trainer: nothing it knew of. Each process group and cgroup is held by this process's
reaper (rlkit/sandbox/reaper.py) until it is killed, so a trainer that is SIGKILLed leaves no worker's child
running; and the first `ProcessCap` of a process removes the cgroups of trainers that are gone
(`sweep_stale_cgroups`), killing what is left in them. A cgroup is named `rlkit-<pid namespace>-<pid>-<start
time>-<n>` after the process that made it (`owner_tag`), so a process that reuses the pid, or one of another
pid namespace sharing the cgroup tree (a container), is never taken for its maker: a cgroup counts as stale
only when its maker is of this pid namespace and no process with its pid and start time lives; anything else
is left alone.

Signals (`default_signals_for_children`): a worker catches SIGINT / SIGTERM (a handler, not SIG_IGN) and
sets SIGQUIT to its default, so what it starts gets default dispositions.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import os
import re
import resource
import signal
import threading

from rlkit.sandbox.reaper import REAPER, kill_cgroup, mounts, pids_controller, remove_cgroup

log = logging.getLogger(__name__)

_SEQ = itertools.count()


def limit_this_worker(memory_limit_mb: int | None, cgroup: str | None) -> None:
    """In a fresh worker process: new session, OOM-killer preference, memory caps, its pids and memory cgroups."""
    if memory_limit_mb is not None:  # before anything forks, so every child is in it
        cap_memory(memory_twin(cgroup), resident_bytes() + (int(memory_limit_mb) << 20))
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
        # On top of what the worker holds at its start: one forked from the fork server inherits the server's
        # private memory (the modules it preloaded, whichever run of this process started it), and a cap below
        # that failed the worker's first thread ("did not start within 60s").
        limit = private_data_bytes() + (int(memory_limit_mb) << 20)
        resource.setrlimit(resource.RLIMIT_DATA, (limit, limit))


def resident_bytes() -> int:
    """This process's resident memory now (VmRSS in /proc/self/status); 0 where it cannot be read."""
    return _status_bytes("VmRSS:")


def private_data_bytes() -> int:
    """What RLIMIT_DATA counts of this process now (VmData in /proc/self/status); 0 where it cannot be read."""
    return _status_bytes("VmData:")


def _status_bytes(field: str) -> int:
    with contextlib.suppress(OSError, ValueError):
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field):
                    return int(line.split()[1]) << 10
    return 0


MEMORY_LIMITS = ("memory.max", "memory.limit_in_bytes")  # cgroup2's, cgroup v1's
MEMORY_EVENTS = ("memory.events", "memory.oom_control")  # where each counts its OOM kills (`oom_kill N`)


def memory_twin(cgroup: str | None) -> str | None:
    """The memory cgroup `ProcessCap.cgroup_for` made beside worker cgroup `cgroup`: the same two names below
    a memory root (on cgroup2 the same folder); None where there is none."""
    if cgroup is None:
        return None
    tail = os.path.join(*cgroup.rstrip("/").split("/")[-2:])
    for root in _memory_cgroup_roots():
        path = os.path.join(root, tail)
        if any(os.path.isfile(os.path.join(path, f)) for f in MEMORY_LIMITS):
            return path
    return None


def cap_memory(path: str | None, limit_bytes: int) -> None:
    """Set memory cgroup `path`'s limit to `limit_bytes` and move this process into it (nothing where `path` is
    None or cannot be written). The kernel charges every page the process and its children touch from now on,
    shared memory and tmpfs files included, and kills them (the cgroup's OOM killer) past the limit."""
    if path is None:
        return
    with contextlib.suppress(OSError):
        limits = [f for f in MEMORY_LIMITS if os.path.isfile(os.path.join(path, f))]
        with open(os.path.join(path, limits[0]), "w") as f:
            f.write(str(limit_bytes))
        with open(os.path.join(path, "cgroup.procs"), "w") as f:
            f.write(str(os.getpid()))


def memory_cap_hit(cgroup: str | None) -> bool:
    """Worker cgroup `cgroup`'s memory twin has killed a process for passing its limit."""
    twin = memory_twin(cgroup)
    for name in MEMORY_EVENTS if twin else ():
        for line in _read(os.path.join(twin, name)).splitlines():
            key, _, value = line.partition(" ")
            if key == "oom_kill" and value.strip().isdigit() and int(value) > 0:
                return True
    return False


def _caught(signum, frame) -> None:
    """SIGINT / SIGTERM in a worker: dropped (see `default_signals_for_children`)."""


def _default_signals() -> None:
    for signum in (signal.SIGINT, signal.SIGTERM, signal.SIGQUIT):
        with contextlib.suppress(ValueError, OSError):
            signal.signal(signum, signal.SIG_DFL)


def default_signals_for_children() -> None:
    """In a worker: SIGINT and SIGTERM (a signal to the trainer's process group: Ctrl-C, `timeout`, Slurm,
    systemd; the trainer's to handle) are caught and dropped, and SIGQUIT is back to its default.

    A caught signal, unlike an ignored one (SIG_IGN), is reset to its default by `exec`, so what the worker
    starts (a tool server, a compiler) can be stopped by SIGTERM, Ctrl-C or SIGQUIT; a child forked without
    exec gets the defaults too (os.register_at_fork). SIGQUIT is reset because a shell that starts the trainer
    in the background makes it ignore SIGINT and SIGQUIT, and that would pass to everything it starts."""
    signal.signal(signal.SIGINT, _caught)
    signal.signal(signal.SIGTERM, _caught)
    signal.signal(signal.SIGQUIT, signal.SIG_DFL)
    os.register_at_fork(after_in_child=_default_signals)


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


PROC_CGROUP = "/proc/self/cgroup"
"""This process's cgroups (a test points it at a fake one, with reaper.MOUNTINFO)."""


def _relative(path: str, mount_root: str) -> str | None:
    """`path` (of /proc/self/cgroup) below the root of a mount of its hierarchy; None when outside it."""
    if mount_root == "/":
        return path
    if path == mount_root or path.startswith(mount_root.rstrip("/") + "/"):
        return path[len(mount_root.rstrip("/")) :] or "/"
    return None


def _pids_cgroup_roots() -> list[str]:
    """Where this process can make pids cgroups (`_cgroup_roots("pids")`)."""
    return _cgroup_roots("pids")


def _memory_cgroup_roots() -> list[str]:
    """Where this process can make memory cgroups (`_cgroup_roots("memory")`)."""
    return _cgroup_roots("memory")


def _cgroup_roots(controller: str) -> list[str]:
    """Where this process can make `controller` cgroups: its cgroup in a mounted cgroup v1 hierarchy with the
    controller, then its cgroup in a mounted cgroup2 file system whose root offers it. Only real cgroup
    mounts count (reaper.mounts: fs type and options from /proc/self/mountinfo), never a path guessed under
    /sys/fs/cgroup, which on cgroup v1 is a writable tmpfs where "pids.max" is a plain file."""
    try:
        with open(PROC_CGROUP) as f:
            lines = [line.rstrip("\n").split(":", 2) for line in f if line.count(":") >= 2]
    except OSError:
        return []
    table = mounts()
    roots = []
    for hierarchy, controllers, path in lines:  # (v1 hierarchies are listed before v2's "0::")
        v2 = hierarchy == "0" and controllers == ""
        if not v2 and controller not in controllers.split(","):
            continue
        for point, mount_root, fstype, options in table:
            if not pids_controller(fstype, options, controller) or (fstype == "cgroup2") != v2:
                continue
            below = _relative(path, mount_root)
            if below is None:
                continue
            root = (point.rstrip("/") + below).rstrip("/") or "/"
            if v2 and controller not in _read(os.path.join(root, "cgroup.controllers")).split():
                continue
            if root not in roots:
                roots.append(root)
    return roots


def _read(path: str) -> str:
    try:
        with open(path) as f:
            return f.read()
    except OSError:
        return ""


def kill_group(pid: int, cgroup: str | None) -> None:
    """SIGKILL worker `pid`'s process group (it leads it) and whatever is left in its cgroup."""
    with contextlib.suppress(OSError):
        os.killpg(pid, signal.SIGKILL)
    if cgroup is not None:
        kill_cgroup(cgroup)


def cgroup_members(cgroup: str | None) -> list[int]:
    """The processes in cgroup `cgroup` ([] without one, or when it cannot be read)."""
    if cgroup is None:
        return []
    try:
        with open(os.path.join(cgroup, "cgroup.procs")) as f:
            return [int(p) for p in f.read().split()]
    except OSError:
        return []


def shared_mib(pid: int) -> int:
    """The shared memory `pid` has touched, in MiB (RssShmem: shared anonymous mappings such as
    mmap(-1, n), SysV and POSIX shared memory, tmpfs files it maps); 0 when it cannot be read."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("RssShmem:"):
                    return int(line.split()[1]) >> 10  # kB
    except (OSError, ValueError, IndexError):
        pass
    return 0


def over_shared_memory(workers: dict[int, str | None], limit_mb: int | None) -> tuple[int, int] | None:
    """(worker pid, MiB) of the first worker (`workers`: pid -> its cgroup) one of whose processes (the
    worker, and where it has a cgroup, all in it) holds more than `limit_mb` MiB of shared memory; None
    when none does. RLIMIT_DATA does not count shared memory, so the caller polls this (every POLL_S)."""
    if limit_mb is None:
        return None
    for pid, cgroup in workers.items():
        for member in {pid, *cgroup_members(cgroup)}:
            mib = shared_mib(member)
            if mib > limit_mb:
                return pid, mib
    return None


def _pid_namespace() -> int:
    """The inode of this process's pid namespace (0 where it cannot be read)."""
    try:
        return os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        return 0


def start_time(pid: int) -> int | None:
    """`pid`'s start time (clock ticks after boot, /proc/PID/stat field 22) in this pid namespace's view; None
    when no such process is visible (a zombie counts as gone)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    if fields[0] in ("Z", "X"):
        return None
    return int(fields[19])


def owner_tag(pid: int | None = None) -> str:
    """`<pid namespace>-<pid>-<start time>` of `pid` (this process by default): the owner part of its cgroups'
    names, which a reused pid (another start time) or a process of another pid namespace cannot share."""
    pid = os.getpid() if pid is None else pid
    return f"{_pid_namespace()}-{pid}-{start_time(pid) or 0}"


STALE = re.compile(r"rlkit-(\d+)-(\d+)-(\d+)-\d+")
"""The name of a batch's (or a scorer's) pids cgroup: rlkit-<owner_tag of the process that made it>-<n>."""


def _owner_gone(match: re.Match) -> bool:
    """The maker of a cgroup named `match` is gone in this process's view: same pid namespace, and no live
    process with its pid and start time. A cgroup made in another pid namespace is never judged."""
    namespace, pid, started = (int(g) for g in match.groups())
    if namespace != _pid_namespace() or namespace == 0:
        return False
    return start_time(pid) != started


def sweep_stale_cgroups() -> list[str]:
    """Remove the `rlkit-<owner>-<n>` pids cgroups whose maker is gone (`_owner_gone`), killing what is left in
    them (a trainer killed together with its reaper); returns the paths removed. Their `pids.max` is not
    touched (this process did not make them); cgroups of live makers, of other pid namespaces, or in any other
    naming are left alone."""
    removed = []
    for root in dict.fromkeys(_pids_cgroup_roots() + _memory_cgroup_roots()):
        try:
            names = os.listdir(root)
        except OSError:
            continue
        for name in names:
            path = os.path.join(root, name)
            match = STALE.fullmatch(name)
            if match and _owner_gone(match) and os.path.isdir(path):
                remove_cgroup(path, freeze=False)
                if not os.path.exists(path):
                    removed.append(path)
                else:
                    log.warning("could not remove the pids cgroup %s left by a process that is gone", path)
    if removed:
        log.warning("removed %d pids cgroup(s) left by processes that are gone: %s", len(removed), removed)
    return removed


_SWEPT = [False]
_SAID = [False]  # "no pids cgroup here" is logged once per process


class ProcessCap:
    """At most `max_processes` processes and threads in the workers of one batch (or one scorer) and all
    they start (see the module doc). `cgroup_for(k)` is worker k's cgroup (None in the fallback)."""

    def __init__(self, max_processes: int | None):
        self.max_processes = max_processes
        self.path: str | None = None
        if not _SWEPT[0]:  # start-up of containment in this process
            _SWEPT[0] = True
            sweep_stale_cgroups()
        name = f"rlkit-{owner_tag()}-{next(_SEQ)}"
        self._make_pids(name, max_processes)
        self.memory_path = self._make_memory(name)

    def _make_pids(self, name: str, max_processes: int | None) -> None:
        roots = _pids_cgroup_roots()
        for root in roots:
            path = os.path.join(root, name)
            try:
                os.mkdir(path)  # (an existing one is never taken over)
            except OSError:
                continue
            try:
                with open(os.path.join(path, "pids.max"), "w") as f:
                    f.write("max" if max_processes is None else str(max_processes))
                self.path = path
                REAPER.hold_cgroup(path)
                return
            except OSError:
                with contextlib.suppress(OSError):
                    os.rmdir(path)
        if not _SAID[0]:
            _SAID[0] = True
            log.warning(
                "no pids cgroup can be made here (%s): the process cap%s counts the workers' process groups "
                "instead, and a process that leaves its group (setsid) escapes it and the end-of-batch kill",
                f"not writable: {', '.join(roots)}" if roots else "no cgroup v1 pids or cgroup2 mount with the "
                "pids controller holds this process's cgroup", "" if max_processes is not None else " (none set)",
            )  # fmt: skip

    def _make_memory(self, name: str) -> str | None:
        """The parent of the workers' memory cgroups (the memory cap, `limit_this_worker`), where a memory
        controller is writable (only beside a pids cgroup: the pids cgroup finds and kills the processes)."""
        if self.path is None:
            return None
        for root in _memory_cgroup_roots():
            path = os.path.join(root, name)
            if path == self.path:  # cgroup2: one folder holds both controllers, once its children get memory
                with contextlib.suppress(OSError):
                    with open(os.path.join(path, "cgroup.subtree_control"), "w") as f:
                        f.write("+memory")
                    return path
                continue
            try:
                os.mkdir(path)
            except OSError:
                continue
            REAPER.hold_cgroup(path)
            return path
        return None

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
        if self.memory_path not in (None, self.path):
            with contextlib.suppress(OSError):
                os.mkdir(os.path.join(self.memory_path, f"w{k}"))
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

    def release(self, cgroup: str | None) -> None:
        """Kill whatever is in child cgroup `cgroup` (of `cgroup_for`) and remove it (and its memory twin)."""
        if cgroup is not None:
            twin = memory_twin(cgroup)
            remove_cgroup(cgroup)
            if twin not in (None, cgroup):
                remove_cgroup(twin)

    def close(self) -> None:
        """Kill whatever is still in the cgroups and remove them; safe to call twice."""
        if self.path is None:
            return
        path, self.path = self.path, None
        remove_cgroup(path)
        REAPER.release_cgroup(path)
        memory, self.memory_path = self.memory_path, None
        if memory not in (None, path):
            remove_cgroup(memory)
            REAPER.release_cgroup(memory)
