"""Shared memory, which RLIMIT_DATA does not count, is held to env.memory_limit_mb too: where a memory cgroup can
be made, the kernel charges every page a worker and what it starts touch (shared memory and /dev/shm files
included) and kills it past the cap (rlkit/sandbox/containment.py cap_memory); besides, the batch's processes are
read a few times a second and a worker whose shared memory is over the cap is killed (over_shared_memory). Either
way its episode fails with the reason."""

import os

import pytest

from rlkit.envs.workers import EnvWorkers, Limits
from rlkit.sandbox import containment

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
    assert status == "error" and f"passed env.memory_limit_mb={CAP_MB}" in why, why
    if "killed by its memory cgroup" not in why:  # the poll saw it first
        assert "its shared memory" in why, why
        mib = int(why.split("(")[1].split()[0])
        assert CAP_MB < mib <= 768


def _memory_cgroups() -> bool:
    cap = containment.ProcessCap(None)
    try:
        return cap.memory_path is not None
    finally:
        cap.close()


@pytest.mark.skipif(
    not _memory_cgroups(), reason="no writable memory cgroup on this machine (the poll is the bound)"
)
def test_a_fast_dev_shm_file_is_stopped_at_the_cap_by_the_memory_cgroup(tmp_path):
    """Issue 56: a file written into /dev/shm fast reached 1.4 GB against a 200 MB cap, since a poll cannot
    bound a fast allocation (and RssShmem never counts a tmpfs file nobody maps). The memory cgroup's bound is
    the kernel's: the worker dies at the cap plus what it held at its start."""
    path, progress = f"/dev/shm/rlkit-test-hog-{os.getpid()}", tmp_path / "progress"
    try:
        status, why = _step(
            "ShmFileHog",
            {"mb": 1536, "path": path, "progress": str(progress)},
            Limits(memory_limit_mb=CAP_MB),
            timeout_s=60,
        )
        written = os.path.getsize(path) >> 20
    finally:
        if os.path.exists(path):
            os.unlink(path)
    assert status == "error" and "killed by its memory cgroup" in why, why
    assert f"env.memory_limit_mb={CAP_MB}" in why
    # the worker's resident memory at its start (a forked Python with rlkit imported) is the rest of the bound
    assert CAP_MB // 2 < written < CAP_MB + 400, written
    assert int(progress.read_text()) <= written


def test_shared_memory_under_the_cap_is_left_alone():
    assert _step("SharedSmall", {"mb": 16}, Limits(memory_limit_mb=CAP_MB), timeout_s=20) == (
        "ok",
        (None, 1.0, True),
    )
