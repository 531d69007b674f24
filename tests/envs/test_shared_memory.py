"""Shared anonymous memory (mmap(-1, n)), which RLIMIT_DATA does not count, is held to env.memory_limit_mb
too: the batch's processes are read a few times a second and a worker over the cap is killed, its episode
failing with the reason (rlkit/sandbox/containment.py over_shared_memory)."""

import pytest

from rlkit.envs.workers import EnvWorkers, Limits

pytestmark = pytest.mark.slow  # environment worker processes: `make test-fast` leaves it out


def _step(name, kwargs, limits, timeout_s):
    workers = EnvWorkers(f"rlkit_test_doors:{name}", kwargs, 1, timeout_s=timeout_s, limits=limits)
    try:
        assert workers.call("make", {0: ()})[0][0] == "ok"
        return workers.call("step", {0: ("a",)})[0]
    finally:
        workers.close()


# The cap also bounds the worker's heap (RLIMIT_DATA), which starts with what its fork server holds: after the other
# tests of tests/envs had run in the same session, a 100 MiB cap left the worker no room to start a thread.
CAP_MB = 512


def test_shared_memory_over_the_cap_fails_its_episode_with_the_reason():
    status, why = _step("SharedHog", {"mb": 768}, Limits(memory_limit_mb=CAP_MB), timeout_s=20)
    assert (
        status == "error" and "its shared memory" in why and f"passed env.memory_limit_mb={CAP_MB}" in why
    ), why
    mib = int(why.split("(")[1].split()[0])
    assert CAP_MB < mib <= 768


def test_shared_memory_under_the_cap_is_left_alone():
    assert _step("SharedSmall", {"mb": 16}, Limits(memory_limit_mb=CAP_MB), timeout_s=20) == (
        "ok",
        (None, 1.0, True),
    )
