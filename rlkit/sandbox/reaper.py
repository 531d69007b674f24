"""The reaper: a small process that outlives the trainer long enough to kill what its workers started.

Environment and reward workers lead their own process groups and sit in pids cgroups
(rlkit/sandbox/containment.py); killing those is the trainer's job at the end of a batch. A trainer that is
SIGKILLed (the OOM killer, `kill -9`, a node drain) cannot do it: its workers die with it (PR_SET_PDEATHSIG),
but a process a worker started, in its group or in a session of its own, would live on under init. So each
process that holds such groups and cgroups starts one reaper (`REAPER`, on first use) and tells it what it
holds and lets go of. The reaper waits; when its parent is gone (its pipe reaches end of file, or its parent
pid changes: checked every `POLL_S`), it SIGKILLs every process group and everything in every cgroup it was
told of, removes the cgroups and exits. A parent that exits normally has let go of everything first.

The reaper runs this file as a script (`python -I`): it imports nothing of rlkit or of the trainer's
environment, starts in tens of milliseconds and shares no state with the trainer but its pipe, on which the
trainer writes lines (`group <pgid>`, `cgroup <path>`, and `un...` to let go). It leads a session of its
own, so a SIGKILL to the trainer's process group (`kill -9 -<pgid>`) does not take it along.

The cgroup helpers (`kill_cgroup`, `remove_cgroup`, `on_pids_cgroup`) live here so that the reaper and the
trainer share them. A pid is signalled only when it was read from the `cgroup.procs` of a real cgroup file
system with the pids controller (`on_pids_cgroup`: the deepest mount holding the path, from
/proc/self/mountinfo, is cgroup2, or cgroup v1 with `pids` among its options), never from a plain file that
merely has that name (cgroup v1's /sys/fs/cgroup itself is a writable tmpfs).
"""

from __future__ import annotations

import contextlib
import os
import re
import select
import signal
import subprocess
import sys
import threading
import time

POLL_S = 0.5
"""How often the reaper checks that its parent is still its parent (the pipe's end of file is the fast path)."""


MOUNTINFO = "/proc/self/mountinfo"
"""Where the mounts are read (a test points it at a fake one)."""


def _unescape(field: str) -> str:
    """A mountinfo path field: space, tab, newline and backslash are written as octal escapes (\\040)."""
    return re.sub(r"\\([0-7]{3})", lambda m: chr(int(m[1], 8)), field)


def mounts(mountinfo: str | None = None) -> list[tuple[str, str, str, set[str]]]:
    """(mount point, root of the mount inside its file system, fs type, super options) of every mount."""
    out = []
    try:
        with open(mountinfo or MOUNTINFO) as f:
            lines = f.read().splitlines()
    except OSError:
        return out
    for line in lines:
        left, sep, right = line.partition(" - ")
        fields, tail = left.split(), right.split()
        if not sep or len(fields) < 5 or len(tail) < 3:
            continue
        out.append((_unescape(fields[4]), _unescape(fields[3]), tail[0], set(tail[2].split(","))))
    return out


def pids_controller(fstype: str, options: set[str], controller: str = "pids") -> bool:
    """A cgroup file system that can hold `controller` cgroups: cgroup2, or cgroup v1 mounted with it."""
    return fstype == "cgroup2" or (fstype == "cgroup" and controller in options)


def on_pids_cgroup(path: str, mountinfo: str | None = None, controller: str = "pids") -> bool:
    """True when `path` lies on a cgroup file system with the pids controller (or `controller`: the memory
    cgroups of containment's memory cap) (the deepest mount holding it)."""
    real = os.path.realpath(path)
    best = None
    for point, _, fstype, options in mounts(mountinfo):
        inside = real == point or real.startswith(point.rstrip("/") + "/")
        if inside and (best is None or len(point) > len(best[0])):
            best = (point, fstype, options)
    return best is not None and pids_controller(best[1], best[2], controller)


def on_cgroup(path: str) -> bool:
    """`path` is on a real cgroup file system of the pids or the memory controller (what rlkit makes)."""
    return on_pids_cgroup(path) or on_pids_cgroup(path, controller="memory")


def kill_cgroup(path: str, budget_s: float = 2.0, *, freeze: bool = True) -> None:
    """SIGKILL every process in cgroup `path` until it is empty; with `freeze` (a cgroup this process, or the
    trainer this reaper serves, made) new forks are refused first (`pids.max` 0). Nothing is signalled unless
    `path` is on a real pids (or memory) cgroup file system (`on_cgroup`)."""
    if not on_cgroup(path):
        return
    if freeze:
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


def rmdir(path: str, budget_s: float = 2.0) -> None:
    """Remove an (emptied) cgroup; its last processes may take a moment to leave it."""
    end = time.monotonic() + budget_s
    while True:
        try:
            os.rmdir(path)
            return
        except FileNotFoundError:
            return
        except OSError:
            if time.monotonic() >= end:
                return
            time.sleep(0.01)


def remove_cgroup(path: str, *, freeze: bool = True) -> None:
    """Kill everything in cgroup `path` and in its child cgroups, then remove them all (`freeze`:
    `kill_cgroup`'s). A path that is not on a pids (or memory) cgroup file system is left as it is."""
    if not on_cgroup(path):
        return
    with contextlib.suppress(OSError):
        for sub in os.listdir(path):
            if os.path.isdir(os.path.join(path, sub)):
                remove_cgroup(os.path.join(path, sub), freeze=freeze)
    kill_cgroup(path, freeze=freeze)
    rmdir(path)


def _reap(groups: dict, cgroups: dict) -> None:
    for _ in range(3):  # a member may fork while its group is being killed
        for pgid in groups:
            with contextlib.suppress(OSError):
                os.killpg(pgid, signal.SIGKILL)
        time.sleep(0.01)
    for path in cgroups:
        remove_cgroup(path)


def main() -> None:
    """The reaper's loop (see the module doc); `argv[1]` is the parent's pid."""
    parent = int(sys.argv[1])
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    groups: dict[int, None] = {}
    cgroups: dict[str, None] = {}
    buffer = b""
    fd = sys.stdin.fileno()
    while os.getppid() == parent:
        ready, _, _ = select.select([fd], [], [], POLL_S)
        if not ready:
            continue
        chunk = os.read(fd, 1 << 16)
        if not chunk:
            break
        *lines, buffer = (buffer + chunk).split(b"\n")
        for line in lines:
            verb, _, value = line.decode().partition(" ")
            if verb == "group":
                groups[int(value)] = None
            elif verb == "ungroup":
                groups.pop(int(value), None)
            elif verb == "cgroup":
                cgroups[value] = None
            elif verb == "uncgroup":
                cgroups.pop(value, None)
    _reap(groups, cgroups)


class Reaper:
    """This process's reaper (started on first use; restarted, with everything held, if it died)."""

    def __init__(self):
        self._lock = threading.Lock()
        self._proc: subprocess.Popen | None = None
        self._held: dict[str, None] = {}  # the lines that hold something, to replay to a new reaper

    def _start(self) -> None:
        self._proc = subprocess.Popen(
            [sys.executable, "-I", os.path.abspath(__file__), str(os.getpid())],
            stdin=subprocess.PIPE, start_new_session=True, close_fds=True,
        )  # fmt: skip
        self._proc.stdin.write(b"".join(line.encode() + b"\n" for line in self._held))
        self._proc.stdin.flush()

    def _send(self, line: str) -> None:
        with self._lock:
            if line.startswith("un"):
                self._held.pop(line[2:], None)
            else:
                self._held[line] = None
            for _ in range(2):
                try:
                    if self._proc is None or self._proc.poll() is not None:
                        self._start()  # (it writes every held line, this one included)
                    else:
                        self._proc.stdin.write(line.encode() + b"\n")
                        self._proc.stdin.flush()
                    return
                except OSError:  # it died between the check and the write: start another
                    self._proc = None

    def hold_group(self, pgid: int) -> None:
        """Kill process group `pgid` if this process dies before `release_group`."""
        self._send(f"group {pgid}")

    def release_group(self, pgid: int) -> None:
        self._send(f"ungroup {pgid}")

    def hold_cgroup(self, path: str) -> None:
        """Kill everything in cgroup `path` (and its children) and remove it if this process dies first."""
        self._send(f"cgroup {path}")

    def release_cgroup(self, path: str) -> None:
        self._send(f"uncgroup {path}")

    def _forget(self) -> None:
        """In a child forked from this process: the reaper is the parent's (the child closes its pipe, so the
        parent's death still reaches the reaper as end of file)."""
        if self._proc is not None and self._proc.stdin is not None:
            with contextlib.suppress(OSError, ValueError):
                self._proc.stdin.close()
        self._lock = threading.Lock()
        self._proc, self._held = None, {}


REAPER = Reaper()
os.register_at_fork(after_in_child=REAPER._forget)


if __name__ == "__main__":
    main()
