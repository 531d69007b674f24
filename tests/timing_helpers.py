"""Wall-clock bounds that hold on a loaded machine (the CI runner, or 2 cores shared with other work).

A test that asserts "this took under N seconds" guards against a bug that takes far longer (a default timeout,
a hang); N itself is what the code needs on an idle machine. `within` scales N by how loaded the machine is
now, and keeps it under the bug's time so the bound still tells the fix from the bug."""

import os

MARGIN = 0.8
"""A scaled bound stays under this share of the bug's time (`failure_s`)."""


def slowdown() -> float:
    """How many times slower than idle this machine runs now: the runnable tasks per core (1-minute load
    average over the cores), at least 1. RLKIT_TEST_SLOWDOWN, if set, is used instead."""
    if "RLKIT_TEST_SLOWDOWN" in os.environ:
        return max(1.0, float(os.environ["RLKIT_TEST_SLOWDOWN"]))
    try:
        load = os.getloadavg()[0]
    except OSError:
        return 1.0
    return max(1.0, load / (os.cpu_count() or 1))


def within(seconds: float, *, failure_s: float) -> float:
    """The bound for something that takes `seconds` on an idle machine and `failure_s` (or longer) when the bug
    it guards against is back: `seconds` x `slowdown()`, at most MARGIN x `failure_s` (and never below
    `seconds`)."""
    return max(seconds, min(seconds * slowdown(), MARGIN * failure_s))
