"""Nothing an environment or a reward function starts outlives a trainer that is SIGKILLed
(rlkit/rewards/reaper.py), and start-up removes the pids cgroups of trainers that are gone."""

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from proc_helpers import alive, cgroup_root, cgroups_of, kill_all, recorded, wait_dead, wait_for
from run_helpers import FIXTURES

from rlkit.rewards.containment import sweep_stale_cgroups

TRAINER = """
import sys
from rlkit.envs.workers import EnvWorkers
from rlkit.rewards import RewardScorer

record = sys.argv[1]
workers = EnvWorkers("rlkit_test_doors:LeavesProcesses", {"record": record + "/env"}, 2, timeout_s=60)
assert all(s == "ok" for s, _ in workers.call("make", {0: (), 1: ()}).values())
assert all(s == "ok" for s, _ in workers.call("step", {0: ("a",), 1: ("a",)}).values())
scorer = RewardScorer("rlkit_test_reward_doors:leaves_a_session_and_hangs", num_workers=1, timeout_s=600)
scorer.score(["p"], ["r"], ["a"], rows=[{"record": record + "/reward"}])  # hangs until the test kills us
"""


def test_a_sigkilled_trainer_leaves_nothing_its_workers_started_and_no_cgroup(tmp_path):
    """A "trainer" with a batch of 2 environment workers whose steps left 3 processes each (one in the
    worker's group, one in a session of its own, one forked) and a reward call that left a process in its
    own session and hangs, is SIGKILLed: within a few seconds all 7 are gone, and its cgroups too."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(FIXTURES), *sys.path])}
    trainer = subprocess.Popen([sys.executable, "-c", TRAINER, str(tmp_path)], env=env)
    try:
        wait_for(
            lambda: len(recorded(tmp_path / "env")) == 6 and recorded(tmp_path / "reward"), 120, "the steps"
        )
        pids = recorded(tmp_path / "env") + recorded(tmp_path / "reward")
        assert all(map(alive, pids))
        with_cgroups = cgroup_root() is not None
        assert not with_cgroups or cgroups_of(trainer.pid)
        trainer.send_signal(signal.SIGKILL)
        trainer.wait()
        escaped = [recorded(tmp_path / "env")[k] for k in (1, 4)] + recorded(tmp_path / "reward")
        expected = pids if with_cgroups else [p for p in pids if p not in escaped]  # sessions need cgroups
        assert wait_dead(expected, within_s=10) == []
        assert wait_for(lambda: cgroups_of(trainer.pid) == [], 10, "the cgroups to go")
    finally:
        trainer.kill()
        kill_all(recorded(tmp_path / "env") + recorded(tmp_path / "reward"))


def test_start_up_removes_the_cgroups_of_trainers_that_are_gone():
    root = cgroup_root()
    if root is None:
        pytest.skip("no writable pids cgroup here")
    gone = subprocess.Popen(["true"])
    gone.wait()
    stale, live = Path(root) / f"rlkit-{gone.pid}-3", Path(root) / f"rlkit-{os.getpid()}-999999"
    (stale / "w0").mkdir(parents=True)
    live.mkdir()
    sleeper = subprocess.Popen(["sleep", "600"])
    try:
        (stale / "w0" / "cgroup.procs").write_text(str(sleeper.pid))
        removed = sweep_stale_cgroups()
        assert str(stale) in removed and not stale.exists()
        assert sleeper.wait(timeout=10) == -signal.SIGKILL  # what was left in it is killed
        assert live.exists() and str(live) not in removed  # a live process's cgroup is left alone
    finally:
        sleeper.kill()
        live.rmdir()
