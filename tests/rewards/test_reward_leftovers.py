"""Reward workers are contained like environment workers: a pids cgroup each, swept at the end of every
batch (a child in a session of its own included), and what a function starts gets default signal
dispositions, even when the trainer was started ignoring SIGINT and SIGQUIT (a shell's background job)."""

import signal

import pytest
from proc_helpers import GROUP_SIGNALS, alive, cgroup_root, kill_all, recorded, wait_dead, wait_for

from rlkit.rewards import RewardScorer

M = "rlkit_test_reward_doors"


def test_a_reward_functions_child_in_its_own_session_dies_at_the_end_of_the_batch(tmp_path):
    if cgroup_root() is None:
        pytest.skip("no writable pids cgroup here (a process that leaves its group is then out of reach)")
    record = tmp_path / "pids"
    scorer = RewardScorer(f"{M}:leaves_a_session", num_workers=1, timeout_s=60)
    try:
        scores = scorer.score(["p"] * 2, ["r"] * 2, ["a"] * 2, rows=[{"record": str(record)}] * 2)
        assert scores.total == [1.0, 1.0] and scores.errors == 0
        pids = recorded(record)
        assert len(pids) == 2 and wait_dead(pids) == []  # swept with the batch, the worker lives on
        assert all(alive(w.proc.pid) for w in scorer._workers)
    finally:
        scorer.close()
        kill_all(recorded(record))


def test_what_a_reward_function_starts_gets_default_signal_dispositions(tmp_path):
    record = tmp_path / "pids"
    # As a shell starts a background job: SIGINT and SIGQUIT ignored, inherited by the spawned workers.
    before = {s: signal.signal(s, signal.SIG_IGN) for s in (signal.SIGINT, signal.SIGQUIT)}
    scorer = RewardScorer(f"{M}:starts_children", num_workers=1, timeout_s=60)
    try:
        assert scorer.score(["p"], ["r"], ["a"], rows=[{"record": str(record)}]).total == [1.0]
        lines = wait_for(lambda: len(record.read_text().splitlines()) == 2 and record.read_text(), 10, "both")
    finally:
        scorer.close()
        for s, handler in before.items():
            signal.signal(s, handler)
    for line in lines.splitlines():  # an exec'd child and a forked one
        pid, mask = map(int, line.split())
        assert {s for s in GROUP_SIGNALS if mask >> (s - 1) & 1} == set(), line
