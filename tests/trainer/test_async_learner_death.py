"""Async mode: a learner that is SIGKILLed takes its rollout worker, the worker's reward workers and the
resource tracker with it, whatever the worker is doing (here: still loading, then waiting for the learner's
store, where it used to wait up to trainer.collective_timeout_s)."""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from proc_helpers import alive, kill_all, wait_dead
from run_helpers import FIXTURES, overrides, tiny  # noqa: F401  (tiny is a fixture)

from rlkit.config.schema import REPO_ROOT

pytestmark = pytest.mark.slow  # a launched trainer run: `make test-fast` leaves it out


def _descendants(root: int) -> list[int]:
    children: dict[int, list[int]] = {}
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                ppid = int(Path(f"/proc/{name}/stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError):
                continue
            children.setdefault(ppid, []).append(int(name))
    found, todo = [], [root]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace")
    except OSError:
        return ""


def test_a_sigkilled_learner_takes_its_rollout_worker_along(tiny, tmp_path):  # noqa: F811
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(REPO_ROOT), str(FIXTURES)]),
        "OMP_NUM_THREADS": "1",
    }
    args = overrides(tiny, tmp_path / "run", "trainer.mode=async", "trainer.steps=50")
    learner = subprocess.Popen([sys.executable, "-m", "rlkit.train", *args], env=env, cwd=tmp_path,
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)  # fmt: skip
    seen: list[int] = []
    try:
        deadline = time.monotonic() + 300
        while not any("spawn_main" in _cmdline(p) for p in _descendants(learner.pid)):
            assert learner.poll() is None and time.monotonic() < deadline, "no rollout worker started"
            time.sleep(0.05)
        time.sleep(1.0)  # the worker is loading its model and engine
        seen = _descendants(learner.pid)  # the rollout worker, the resource tracker
        learner.send_signal(signal.SIGKILL)
        learner.wait()
        assert seen and wait_dead(seen, within_s=20) == [], {p: _cmdline(p) for p in seen if alive(p)}
    finally:
        learner.kill()
        kill_all(seen)
