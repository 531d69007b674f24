"""What an environment starts gets default signal dispositions: the worker's own shield against a signal to
the trainer's process group (rlkit/sandbox/containment.py: default_signals_for_children) is not inherited."""

from pathlib import Path

from proc_helpers import GROUP_SIGNALS, ignored_signals, kill_all, recorded

from rlkit.envs.workers import EnvWorkers


def test_processes_an_environment_starts_do_not_ignore_sigterm_sigint_or_sigquit(tmp_path):
    record = tmp_path / "pids"
    workers = EnvWorkers("rlkit_test_doors:LeavesProcesses", {"record": str(record)}, 1, timeout_s=60)
    try:
        assert workers.call("make", {0: ()})[0][0] == "ok"
        assert workers.call("step", {0: ("a",)})[0][0] == "ok"
        pids = recorded(record)  # an exec'd child, one in its own session, a forked child
        assert len(pids) == 3
        for pid in pids:
            assert ignored_signals(pid) & GROUP_SIGNALS == set(), Path(f"/proc/{pid}/cmdline").read_bytes()
    finally:
        workers.close()
        kill_all(recorded(record))
