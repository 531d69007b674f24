"""Environments that go through every door of their worker (what they start, their dataset, their
observations, shared memory), for the tests of tests/envs; imported by path in the worker processes. Those that
start processes record their pids in the file `record` (one per line), so the tests can look for them."""

import mmap
import os
import subprocess
import time

from rlkit.envs import Environment


def _record(path, pids):
    with open(path, "a") as f:
        f.write("".join(f"{p}\n" for p in pids))


def _sleeper_fork() -> int:
    """A child forked without exec that sleeps (it keeps whatever dispositions it inherits)."""
    pid = os.fork()
    if pid == 0:
        time.sleep(600)
        os._exit(0)
    return pid


class LeavesProcesses(Environment):
    """Each step leaves a sleeper in the worker's group, one in a session of its own and a forked copy."""

    def __init__(self, record):
        self.record = record

    def step(self, text):
        plain = subprocess.Popen(["sleep", "600"])
        own_session = subprocess.Popen(["sleep", "600"], start_new_session=True)
        _record(self.record, [plain.pid, own_session.pid, _sleeper_fork()])
        return None, 0.0, True


class ExitingRows(Environment):
    """A dataset (data.path=env) whose `rows` ends its process."""

    @classmethod
    def rows(cls, **_):
        os._exit(9)

    def step(self, text):
        return None, 0.0, True


class HangingRows(Environment):
    @classmethod
    def rows(cls, **_):
        time.sleep(3600)

    def step(self, text):
        return None, 0.0, True


class GoodRows(Environment):
    """Rows made in whatever process calls `rows`; each names that process's pid."""

    @classmethod
    def rows(cls, n=4, **_):
        return [{"question": f"q{i}", "answer": str(i), "pid": os.getpid()} for i in range(n)]

    def step(self, text):
        return None, 0.0, True


class LongObservation(Environment):
    """Every step answers with an observation of `chars` characters (under the 4M-character cap)."""

    def __init__(self, chars=3_000_000):
        self.chars = chars

    def step(self, text):
        return [{"role": "user", "content": "x" * self.chars}], 0.0, False


class SharedHog(Environment):
    """A step that maps `mb` MiB of shared anonymous memory (mmap(-1, n): not counted by RLIMIT_DATA) and
    touches every page, then waits."""

    def __init__(self, mb=256):
        self.mb = mb

    def step(self, text):
        self.memory = mmap.mmap(-1, self.mb << 20)
        for offset in range(0, self.mb << 20, 4096):
            self.memory[offset] = 1
        time.sleep(600)
        return None, 0.0, True


class SharedSmall(Environment):
    """A step that maps and touches `mb` MiB of shared anonymous memory, under the cap, and returns."""

    def __init__(self, mb=16):
        self.mb = mb

    def step(self, text):
        self.memory = mmap.mmap(-1, self.mb << 20)
        for offset in range(0, self.mb << 20, 4096):
            self.memory[offset] = 1
        return None, 1.0, True
