"""Reward functions for the trainer tests (imported by path, also inside reward worker processes)."""

import time

from rlkit.rewards import correct_when


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


def slow_length(prompt, response, answer):
    """`length`, taking 0.5 s; as a call starts it appends its worker's pid to the file named by
    $RLKIT_TEST_REWARD_LOG, so a test can signal a worker that is busy scoring."""
    import os

    path = os.environ.get("RLKIT_TEST_REWARD_LOG")
    if path:
        with open(path, "a") as f:
            f.write(f"{os.getpid()}\n")
    time.sleep(0.5)
    return length(prompt, response, answer)


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


def uses_columns(prompt, response, answer, unit, tolerance):
    """Reads two dataset columns by name: 1.0 when the response mentions the unit, plus the tolerance."""
    return (1.0 if unit in response else 0.0) + float(tolerance)


def all_columns(prompt, response, answer, **columns):
    """Sees every column: the number of columns it got (the fixed arguments are not among them)."""
    return float(len(columns))


def by_source(prompt, response, answer, data_source):
    return {"alpha": 10.0, "beta": 20.0}.get(data_source, -1.0)


@__import__("rlkit.rewards", fromlist=["batched"]).batched
def batch_size_reward(prompts, responses, answers, unit):
    """Batched: every sample gets the size of the batch it was scored in, plus 0.5 if its unit is 'kg'."""
    return [len(prompts) + (0.5 if u == "kg" else 0.0) for u in unit]


@__import__("rlkit.rewards", fromlist=["batched"]).batched
def batched_wrong_length(prompts, responses, answers):
    return [1.0]


@__import__("rlkit.rewards", fromlist=["batched"]).batched
def batched_hanging(prompts, responses, answers):
    time.sleep(600)


def non_numeric(prompt, response, answer):
    return "seven" if "7" in answer else 1.0


def length_target(prompt, response, answer):
    """A non-math task: full marks for an even number of characters, partial credit otherwise."""
    return 1.0 if len(response) % 2 == 0 else 0.25


@correct_when(lambda r: r >= 0.5)
def lenient(prompt, response, answer):
    """Continuous values (any spread counts for filter_metric=reward); correct from 0.5 up."""
    return len(response) % 7 / 7.0


def huge(prompt, response, answer):
    """Rewards whose batch statistics overflow (the mean and std of 1e308s are inf)."""
    return 1e308 * (len(response) % 2)


def always_raising(prompt, response, answer):
    """Fails on every sample (a reward function that does not fit the data)."""
    raise KeyError(f"no metadata for answer {answer!r}")
