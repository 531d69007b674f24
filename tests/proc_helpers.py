"""Looking for processes and pids cgroups in /proc and /sys (shared by the containment tests)."""

import os
import signal
import time
from pathlib import Path

from rlkit.sandbox.containment import STALE, ProcessCap


def alive(pid: int) -> bool:
    """True while `pid` is a live (not zombie) process."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state != "Z"


def recorded(path: Path) -> list[int]:
    return [int(p) for p in Path(path).read_text().split()] if Path(path).exists() else []


def wait_dead(pids, within_s=3.0) -> list[int]:
    """The pids still alive after `within_s` (a SIGKILLed process needs a moment to be reaped by init)."""
    end = time.monotonic() + within_s
    while (left := [p for p in pids if alive(p)]) and time.monotonic() < end:
        time.sleep(0.05)
    return left


def wait_for(predicate, within_s: float, what: str):
    end = time.monotonic() + within_s
    while not (value := predicate()):
        if time.monotonic() > end:
            raise AssertionError(f"timed out after {within_s} s waiting for {what}")
        time.sleep(0.1)
    return value


def cgroup_root() -> str | None:
    """Where this process makes its pids cgroups (None where none is writable)."""
    cap = ProcessCap(64)
    try:
        return None if cap.path is None else os.path.dirname(cap.path)
    finally:
        cap.close()


def cgroups_of(pid: int) -> list[str]:
    """The pids cgroups that process `pid` made (`rlkit-<pid namespace>-<pid>-<start time>-<n>`) that exist."""
    root = cgroup_root()
    if root is None:
        return []
    return [os.path.join(root, n) for n in os.listdir(root) if (m := STALE.fullmatch(n)) and int(m[2]) == pid]


def ignored_signals(pid: int) -> set[int]:
    """The signals `pid` ignores (SigIgn of /proc/<pid>/status)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("SigIgn:"):
            mask = int(line.split()[1], 16)
            return {s for s in range(1, 65) if mask >> (s - 1) & 1}
    return set()


GROUP_SIGNALS = {int(signal.SIGINT), int(signal.SIGQUIT), int(signal.SIGTERM)}


def kill_all(pids) -> None:
    for p in pids:
        try:
            os.kill(p, signal.SIGKILL)
        except OSError:
            pass
