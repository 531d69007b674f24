"""Reward workers die in every way an operator or the kernel can kill them; scoring never hangs, a crash is
seen at once (not by the timeout), and the scorer keeps working. Each call runs under a watchdog so that a
hang fails the test instead of blocking the suite."""

import os
import queue
import signal
import threading
import time

import pytest
from run_helpers import FIXTURES
from timing_helpers import within

from rlkit.rewards import RewardScorer

pytestmark = (
    pytest.mark.slow
)  # reward worker processes that hang, crash and time out: `make test-fast` leaves it out


def bounded(fn, seconds):
    """fn() in a thread; fails the test if it has not returned after `seconds` (a hang)."""
    out = {}

    def target():
        try:
            out["value"] = fn()
        except BaseException as e:  # re-raised in the test thread
            out["error"] = e

    t = threading.Thread(target=target, daemon=True)
    start = time.monotonic()
    t.start()
    t.join(seconds)
    assert not t.is_alive(), f"hung for more than {seconds}s"
    if "error" in out:
        raise out["error"]
    return out["value"], time.monotonic() - start


class Caller:
    """Like `bounded`, but every call runs in one daemon thread that lives as long as the test, so the
    thread that started the workers outlives them and a worker dies only of the signal the test sends."""

    def __init__(self):
        self.tasks = queue.Queue()
        threading.Thread(target=self._loop, daemon=True).start()

    def _loop(self):
        while True:
            fn, out, done = self.tasks.get()
            try:
                out["value"] = fn()
            except BaseException as e:  # re-raised in the test thread
                out["error"] = e
            done.set()

    def __call__(self, fn, seconds):
        out, done = {}, threading.Event()
        start = time.monotonic()
        self.tasks.put((fn, out, done))
        assert done.wait(seconds), f"hung for more than {seconds}s"
        if "error" in out:
            raise out["error"]
        return out["value"], time.monotonic() - start


def alive(pid):
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def running(pid):
    """Alive and not a zombie (a killed worker that is not reaped yet still answers os.kill(pid, 0))."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGKILL], ids=["SIGTERM", "SIGKILL"])
def test_idle_worker_killed_then_scoring_and_close_go_on(sig):
    scorer = RewardScorer("rlkit_test_rewards:pid", timeout_s=30.0, num_workers=2)
    bounded = Caller()  # the workers' starting thread outlives them: only the signal may kill one
    try:
        first, _ = bounded(lambda: scorer.score(["q"] * 4, ["r"] * 4, ["a"] * 4), 120)
        pids = {int(p) for p in first.total}
        assert pids and all(alive(p) for p in pids)
        original = {w.proc.pid for w in scorer._workers}  # a worker may not have scored in the first call
        victim = min(pids)
        os.kill(victim, sig)  # the worker is idle, blocked waiting for its next task
        time.sleep(0.5)
        second, elapsed = bounded(lambda: scorer.score(["q"] * 4, ["r"] * 4, ["a"] * 4), 60)
        assert second.errors == 0 and second.timeouts == 0  # an idle worker's death loses no sample
        assert elapsed < within(
            20, failure_s=60
        )  # far below reward.timeout_s: nothing waited for the dead worker
        now = {int(p) for p in second.total}
        assert all(alive(p) for p in now)
        if sig == signal.SIGKILL:
            assert victim not in now
        else:  # workers ignore SIGTERM (it is the trainer's to handle): the same process goes on scoring
            assert running(victim) and now <= original
        workers = [w.proc.pid for w in scorer._workers]
    finally:
        _, closing = bounded(scorer.close, 30)
    assert closing < 15
    assert not any(alive(p) for p in workers)  # close() leaves no process behind


def test_busy_worker_killed_is_seen_at_once_and_replaced(tmp_path):
    scorer = RewardScorer(
        "rlkit_test_rewards:sleep_then_pid", {"rlkit_test_rewards:pid": 0.0}, timeout_s=60.0, num_workers=1
    )
    marker = tmp_path / "pid"

    def killer():
        for _ in range(600):
            if marker.exists() and marker.read_text():
                os.kill(int(marker.read_text()), signal.SIGKILL)
                return
            time.sleep(0.05)

    try:
        threading.Thread(target=killer, daemon=True).start()
        s, elapsed = bounded(
            lambda: scorer.score(["q"], ["r"], [str(marker)], only=["rlkit_test_rewards:sleep_then_pid"]), 120
        )
        print(f"MEASURED busy-worker-kill detected {elapsed:.1f}s (timeout_s=60)")
        assert s.total == [0.0] and s.errors == 1 and s.timeouts == 0  # a crash, not a timeout
        assert elapsed < within(
            30, failure_s=60
        )  # the sleep is 60 s and the timeout 60 s: the death was seen at once
        again, _ = bounded(lambda: scorer.score(["q"], ["r"], ["a"], only=["rlkit_test_rewards:pid"]), 60)
        assert again.errors == 0 and int(again.total[0]) != int(marker.read_text())
    finally:
        bounded(scorer.close, 30)


def test_reward_that_exits_or_segfaults_is_an_error_seen_at_once():
    scorer = RewardScorer("rlkit_test_rewards:crashing", timeout_s=60.0, num_workers=2)
    try:
        s, elapsed = bounded(
            lambda: scorer.score(["q"] * 5, ["r"] * 5, ["ok", "exit", "segv", "ok", "ok"]), 150
        )
    finally:
        bounded(scorer.close, 30)
    print(f"MEASURED exit+segfault scored {elapsed:.1f}s (timeout_s=60)")
    assert s.total == [1.0, 0.0, 0.0, 1.0, 1.0]  # order kept, crashed samples score 0
    assert s.errors == 2 and s.timeouts == 0
    assert elapsed < within(40, failure_s=60)  # two worker restarts, no 60 s timeout


def test_close_is_idempotent_and_scorer_restarts_after_it():
    scorer = RewardScorer("rlkit_test_rewards:pid", num_workers=1)
    first, _ = bounded(lambda: scorer.score(["q"], ["r"], ["a"]), 120)
    bounded(scorer.close, 30)
    bounded(scorer.close, 30)
    assert not alive(int(first.total[0]))
    second, _ = bounded(lambda: scorer.score(["q"], ["r"], ["a"]), 120)
    bounded(scorer.close, 30)
    assert int(second.total[0]) != int(first.total[0])


def test_workers_started_from_a_thread_outlive_that_thread():
    """PR_SET_PDEATHSIG fires when the starting *thread* exits: workers a short-lived thread started must
    not die with it (they watch the parent's pid instead), while the scorer lives."""
    scorer = RewardScorer("rlkit_test_rewards:pid", num_workers=2)
    try:
        first, _ = bounded(
            lambda: scorer.score(["q"] * 4, ["r"] * 4, ["a"] * 4), 120
        )  # its thread has exited
        pids = [w.proc.pid for w in scorer._workers]
        time.sleep(1.0)
        assert all(running(p) for p in pids), "a worker died with the thread that started it"
        second, _ = bounded(lambda: scorer.score(["q"] * 4, ["r"] * 4, ["a"] * 4), 60)
        assert second.errors == 0 and {int(p) for p in second.total} <= set(pids)  # the same workers
    finally:
        bounded(scorer.close, 30)


def test_workers_started_from_a_thread_die_with_the_trainer(tmp_path):
    """...and still die when the process that owns the scorer is SIGKILLed (no pipe close, no cleanup)."""
    import subprocess
    import sys

    script = tmp_path / "owner.py"
    script.write_text(
        "import threading, time\n"
        "from rlkit.rewards import RewardScorer\n"
        "if __name__ == '__main__':  # workers start by spawn, which re-imports this file\n"
        "    s = RewardScorer('rlkit_test_rewards:pid', num_workers=2)\n"
        "    t = threading.Thread(target=lambda: s.score(['q'] * 4, ['r'] * 4, ['a'] * 4))\n"
        "    t.start(); t.join()\n"
        "    print(' '.join(str(w.proc.pid) for w in s._workers), flush=True)\n"
        "    time.sleep(600)\n"
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(FIXTURES), *sys.path])}
    owner = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True, env=env)
    try:
        pids = [int(p) for p in owner.stdout.readline().split()]
        assert len(pids) == 2 and all(running(p) for p in pids)
        owner.kill()
        owner.wait(10)
        deadline = time.monotonic() + 10
        while any(running(p) for p in pids) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not any(running(p) for p in pids), "a worker outlived the process that started it"
    finally:
        owner.kill()
        for p in pids if "pids" in locals() else []:
            if running(p):
                os.kill(p, signal.SIGKILL)


@pytest.mark.parametrize("with_math", [False, True])
def test_a_worker_imports_math_verify_at_start_only_for_a_run_scoring_with_math(with_math):
    """math's first call would import sympy (a second or two of its time limit): its run's workers import it
    at start (`rlkit_imports`); a run without it does not pay for it. One worker, one sample: the main
    function's call is the worker's first."""
    probe = "rlkit_test_rewards:math_verify_loaded"
    scorer = RewardScorer(probe, extra={"math": 1.0} if with_math else None, num_workers=1, timeout_s=60.0)
    try:
        scores, _ = bounded(lambda: scorer.score(["q"], ["#### 3"], ["3"]), 120)
    finally:
        bounded(scorer.close, 30)
    assert scores.per_fn[probe] == [1.0 if with_math else 0.0]
    if with_math:
        assert scores.per_fn["math"] == [1.0]
