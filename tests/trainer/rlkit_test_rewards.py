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
