"""Nothing an environment or a reward function starts outlives a trainer that is SIGKILLed
(rlkit/sandbox/reaper.py), and start-up removes the pids cgroups of trainers that are gone."""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from proc_helpers import alive, cgroup_root, cgroups_of, kill_all, recorded, wait_dead, wait_for
from run_helpers import FIXTURES

from rlkit.sandbox.containment import owner_tag, sweep_stale_cgroups
from rlkit.sandbox.reaper import remove_cgroup

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
    """A cgroup is stale when its maker (pid namespace, pid, start time in its name) is gone in this view: a dead
    pid, or a live pid with another start time (the pid reused). A live maker's, and one made in another pid
    namespace (whose pids mean nothing here), are left alone, with what is in them."""
    root = cgroup_root()
    if root is None:
        pytest.skip("no writable pids cgroup here")
    gone = subprocess.Popen(["true"])
    gone.wait()
    namespace, me, started = owner_tag().split("-")
    names = {
        "dead": f"rlkit-{namespace}-{gone.pid}-{started}-3",
        "reused": f"rlkit-{namespace}-{me}-{int(started) + 1}-3",  # this pid, another start time
        "live": f"rlkit-{owner_tag()}-999999",
        "elsewhere": f"rlkit-{int(namespace) + 1}-{gone.pid}-{started}-3",  # another pid namespace
    }
    paths = {k: Path(root) / n for k, n in names.items()}
    sleepers = {k: subprocess.Popen(["sleep", "600"]) for k in names}
    try:
        for k, path in paths.items():
            (path / "w0").mkdir(parents=True)
            (path / "w0" / "cgroup.procs").write_text(str(sleepers[k].pid))
        removed = sweep_stale_cgroups()
        assert sorted(removed) == sorted([str(paths["dead"]), str(paths["reused"])])
        for k in ("dead", "reused"):
            assert not paths[k].exists()
            assert sleepers[k].wait(timeout=10) == -signal.SIGKILL  # what was left in it is killed
        time.sleep(0.2)
        for k in ("live", "elsewhere"):
            assert paths[k].exists() and sleepers[k].poll() is None  # left alone
            assert (paths[k] / "pids.max").read_text().strip() == "max"  # never frozen by the sweep
    finally:
        for sleeper in sleepers.values():
            sleeper.kill()
            sleeper.wait()
        for path in paths.values():
            if path.exists():
                remove_cgroup(str(path))
