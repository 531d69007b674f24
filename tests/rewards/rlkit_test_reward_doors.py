"""Reward functions that leave processes behind or fail, for the tests of tests/rewards (imported by path in
the reward workers). Those that start processes record their pids in the row's file `record`."""

import os
import subprocess
import time


def _record(path, pids):
    with open(path, "a") as f:
        f.write("".join(f"{p}\n" for p in pids))


def leaves_a_session(prompt, response, answer, record):
    """Starts a sleeper in a session of its own (out of the worker's process group); 1.0."""
    _record(record, [subprocess.Popen(["sleep", "600"], start_new_session=True).pid])
    return 1.0


def leaves_a_session_and_hangs(prompt, response, answer, record):
    _record(record, [subprocess.Popen(["sleep", "600"], start_new_session=True).pid])
    time.sleep(600)
    return 1.0


def _ignored(pid) -> int:
    with open(f"/proc/{pid}/status") as f:
        return int(next(line for line in f if line.startswith("SigIgn:")).split()[1], 16)


def starts_children(prompt, response, answer, record):
    """Starts an exec'd sleeper and a forked child; each one's ignored signals (SigIgn) go to `record`
    as `pid mask` lines (the forked child writes its own); 1.0."""
    child = subprocess.Popen(["sleep", "600"])  # returns once it has exec'd
    _record(record, [f"{child.pid} {_ignored(child.pid)}"])
    pid = os.fork()
    if pid == 0:
        _record(record, [f"{os.getpid()} {_ignored(os.getpid())}"])
        time.sleep(600)
        os._exit(0)
    return 1.0


def always_fails(prompt, response, answer):
    raise ValueError(f"no verdict for {answer!r}")


def fails_on_odd(prompt, response, answer):
    if int(answer) % 2:
        raise KeyError("odd answer")
    return 1.0
