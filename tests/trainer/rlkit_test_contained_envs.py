"""Environments that try to take the trainer down (memory, processes, constructor, output, rewards), for
tests/trainer/test_containment.py; imported by path in the worker processes. Each records the pids of the
processes it starts in the file `record` (one per line), so the test can look for them in /proc."""

import os
import subprocess
import sys
import time

from rlkit.envs import Environment


def _record(path, pids):
    with open(path, "a") as f:
        f.write("".join(f"{p}\n" for p in pids))


class Hog(Environment):
    """Each step keeps allocating 32 MB blocks (a leak) until it fails; `lazy` blocks are never written
    (numpy.empty: the cap counts them, the machine's RAM does not: for tests with many workers)."""

    stop = (" ", "e")  # a random model's turns end within a few tokens, so steps happen

    def __init__(self, lazy=False, record=None):
        self.hoard, self.lazy, self.record = [], lazy, record

    def step(self, text):
        if self.record is not None:  # and leaves 2 sleepers behind
            _record(self.record, [subprocess.Popen(["sleep", "600"]).pid for _ in range(2)])
        if not self.lazy:
            while True:
                self.hoard.append(bytearray(32 << 20))
        for var in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS"):
            os.environ[var] = (
                "1"  # numpy's BLAS threads (one per core) would reserve memory under the cap too
            )
        import numpy

        while True:
            self.hoard.append(numpy.empty(32 << 20, numpy.uint8))


class Spinners(Environment):
    """A step that runs 4 child processes spinning on the CPU (as a code-execution tool would), then waits
    on them past any timeout."""

    def __init__(self, record):
        self.record = record

    def step(self, text):
        children = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(4)]
        _record(self.record, [c.pid for c in children])
        time.sleep(3600)


class Sleepers(Environment):
    """Each step forks 5 sleepers and returns; with `escape`, one more leaves the process group (setsid)."""

    def __init__(self, record, escape=False):
        self.record, self.escape = record, escape

    def step(self, text):
        children = [subprocess.Popen(["sleep", "600"]) for _ in range(5)]
        if self.escape:
            children.append(subprocess.Popen(["sleep", "600"], start_new_session=True))
        _record(self.record, [c.pid for c in children])
        return [{"role": "user", "content": "Go on."}], 0.0, False


class ForkLoop(Environment):
    """A step that forks sleeping copies of itself in a loop (bounded at `n`, so a broken cap cannot take the
    shared test machine down), retrying when a fork fails, then waits."""

    def __init__(self, record, n=300):
        self.record, self.n = record, n

    def step(self, text):
        made = []
        for _ in range(self.n):
            try:
                pid = os.fork()
            except OSError:
                time.sleep(0.01)
                continue
            if pid == 0:
                time.sleep(600)
                os._exit(0)
            made.append(pid)
            _record(self.record, [pid])
        time.sleep(3600)


class ExitInit(Environment):
    def __init__(self):
        os._exit(7)


class HangInit(Environment):
    def __init__(self):
        time.sleep(3600)


class RaiseInit(Environment):
    def __init__(self):
        raise RuntimeError("no such tool server")


class Rewarding(Environment):
    """A step returning `reward` as it is: 5_000_000 stands for a list of that many elements."""

    def __init__(self, reward):
        self.reward = list(range(5_000_000)) if reward == 5_000_000 else reward

    def step(self, text):
        return None, self.reward, True


class HugeObservation(Environment):
    def step(self, text):
        return [{"role": "user", "content": "x" * 10_000_000}], 0.0, False


class Flood(Environment):
    """A step that writes 8 MB to stdout and 8 MB to stderr, from itself and from a child process."""

    def step(self, text):
        block = "y" * (1 << 20)
        for _ in range(4):
            print(block, flush=True)
            print(block, file=sys.stderr, flush=True)
        subprocess.run([sys.executable, "-c", f"import sys; sys.stdout.write('z' * {4 << 20})"], check=True)
        return None, 1.0, True


# -- reward functions (run in reward workers) ------------------------------------------------------------


def leaves_a_child(prompt, response, answer, record):
    """Starts a sleeper it never waits for; 1.0."""
    _record(record, [subprocess.Popen(["sleep", "600"]).pid])
    return 1.0


def five_million(prompt, response, answer):
    return list(range(5_000_000))


def hogging(prompt, response, answer):
    hoard = []
    while True:
        hoard.append(bytearray(32 << 20))


class KillsForkServer(Environment):
    """A step that SIGKILLs its parent, the fork server the workers come from."""

    def step(self, text):
        import signal

        os.kill(os.getppid(), signal.SIGKILL)
        time.sleep(5)
        return None, 0.0, True
