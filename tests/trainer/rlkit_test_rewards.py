"""Reward functions for the trainer tests (imported by path, also inside reward worker processes)."""

import time


def raising(prompt, response, answer):
    if "3" in answer or len(response) % 3 == 0:
        raise RuntimeError("boom")
    return 1.0


def hanging(prompt, response, answer):
    if "3" in answer or len(response) % 3 == 1:
        time.sleep(600)
    return 0.5


def length(prompt, response, answer):
    """A reward that varies with the response, so a random tiny model gets non-zero advantages."""
    return len(response) % 7 / 7.0


def _gold(answer):
    return int(answer.split("####")[-1].strip().replace(",", ""))


def parity(prompt, response, answer):
    """No spread for a problem with an even answer (always 0.5); response-dependent for an odd one."""
    if _gold(answer) % 2 == 0:
        return 0.5
    return len(response) % 7 / 7.0


def constant(prompt, response, answer):
    """No group ever has spread."""
    return 0.25


def pid(prompt, response, answer):
    """The worker's process id (the tests kill workers by it)."""
    import os

    return float(os.getpid())


def crashing(prompt, response, answer):
    """Ends its process on some samples: exit (answer 'exit'), segfault ('segv'); else 1.0."""
    import ctypes
    import os

    if answer == "exit":
        os._exit(3)
    if answer == "segv":
        ctypes.string_at(0)
    return 1.0


def sleep_then_pid(prompt, response, answer):
    """Writes its pid to the file named by `answer`, sleeps 60 s (the test kills it meanwhile)."""
    import os
    from pathlib import Path

    Path(answer).write_text(str(os.getpid()))
    time.sleep(60)
    return 1.0
