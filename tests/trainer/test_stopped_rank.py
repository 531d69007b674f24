"""A hung rank must not hang everyone: SIGSTOP one of 2 gloo ranks of a running training; every rank ends
within twice trainer.collective_timeout_s (the collective's, then the monitored barrier's), the error names
the stopped rank, rank 0 ends it, and no process (rank or reward worker) is left behind."""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import run_helpers
from run_helpers import launch_env, launcher_folders, overrides, read_jsonl

pytestmark = pytest.mark.slow  # a launched 2-process run: `make test-fast` leaves it out

tiny = run_helpers.tiny  # the tiny model fixture


def _environ(pid):
    try:
        raw = Path(f"/proc/{pid}/environ").read_bytes()
    except OSError:
        return {}
    return dict(kv.split("=", 1) for kv in raw.decode(errors="replace").split("\0") if "=" in kv)


def _ppid(pid):
    return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])


def _session(sid):
    """Pids of the processes of session `sid` (the launcher, its ranks and their reward workers)."""
    out = []
    for p in Path("/proc").iterdir():
        if p.name.isdigit():
            try:
                if os.getsid(int(p.name)) == sid:
                    out.append(int(p.name))
            except (ProcessLookupError, PermissionError):
                pass
    return out


def _all_pids():
    return [int(p.name) for p in Path("/proc").iterdir() if p.name.isdigit()]


def _family(launcher, workers):
    """What is left of the run: its session (launcher, ranks) and those of `workers` still alive."""
    alive = [p for p in workers if Path(f"/proc/{p}").exists() and _state(p) != "Z"]
    return _session(launcher) + alive


def _state(pid):
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return "Z"


def _rank_pid(launcher, rank):
    """The trainer process of `rank`: a child of the launcher whose reward workers have RANK=rank (the
    launcher sets RANK inside the rank process, so only processes it starts show it in /proc). Every process
    is looked at: reward workers lead sessions of their own (rlkit.sandbox.containment)."""
    for pid in _all_pids():
        try:
            parent = _ppid(pid)
            if _environ(pid).get("RANK") == str(rank) and _ppid(parent) == launcher:
                return parent
        except (OSError, IndexError):
            pass
    return None


def test_a_stopped_rank_ends_every_rank_naming_it(tiny, tmp_path):
    run_dir = tmp_path / "d"
    timeout_s = 8
    args = overrides(
        tiny, run_dir, "trainer.steps=500", "trainer.num_processes=2", f"trainer.collective_timeout_s={timeout_s}",
        "trainer.eval_at_start=false",
    )  # fmt: skip
    (tmp_path / "tmp").mkdir()
    env = launch_env(tmp_path / "tmp")  # the launcher's temp folder, checked below
    out = open(tmp_path / "out.txt", "w")
    proc = subprocess.Popen(
        [sys.executable, "-m", "rlkit.train", *args], env=env, stdout=out, stderr=subprocess.STDOUT,
        start_new_session=True,
    )  # fmt: skip
    workers = []
    try:
        deadline = time.monotonic() + 300
        while not (run_dir / "metrics.jsonl").exists() or not read_jsonl(run_dir / "metrics.jsonl"):
            assert proc.poll() is None and time.monotonic() < deadline, (tmp_path / "out.txt").read_text()[
                -3000:
            ]
            time.sleep(0.2)
        victim = _rank_pid(proc.pid, 1)
        assert victim is not None
        # the ranks' reward workers (each leads a session of its own), to check they end too
        workers = [p for p in _all_pids() if _environ(p).get("RANK") in ("0", "1") and p != proc.pid]
        os.kill(victim, signal.SIGSTOP)
        start = time.monotonic()
        rc = proc.wait(timeout=10 * timeout_s)
        elapsed = time.monotonic() - start
        for _ in range(50):  # the reward workers follow their rank within moments
            if not _family(proc.pid, workers):
                break
            time.sleep(0.1)
        left = _family(proc.pid, workers)
    finally:
        for pid in _family(proc.pid, workers):
            os.kill(pid, signal.SIGKILL)
        proc.wait()
    text = (tmp_path / "out.txt").read_text()
    print(f"MEASURED sigstop-to-exit {elapsed:.1f}s (collective_timeout_s={timeout_s})")
    assert rc != 0
    assert "rank 1 stopped responding" in text, text[-5000:]
    assert "trainer.collective_timeout_s=8" in text
    # Rank 0 SIGKILLs the stopped rank on its machine (it cannot act on SIGTERM), so the run ends after the
    # collective's timeout + the monitored barrier's, not after torch's launcher's fixed 30 s grace; slack
    # for a loaded machine.
    assert f"ended rank 1 (pid {victim})" in text, text[-5000:]
    assert elapsed < 2 * timeout_s + 20, elapsed
    assert left == [], left
    assert launcher_folders(tmp_path / "tmp") == []


def test_rank_0_kills_only_a_process_it_names_for_certain():
    """`_end_local` SIGKILLs a stopped rank only when boot id, pid namespace, pid and start time all match what
    the rank reported at start-up: a changed start time (a reused pid) or another machine's boot id is left
    alone."""
    from rlkit.collectives import CollectiveWatch, process_place

    def stopped_child():
        child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
        os.kill(child.pid, signal.SIGSTOP)
        return child

    watch = CollectiveWatch(1, 8)
    children = [stopped_child() for _ in range(3)]
    try:
        places = [process_place(c.pid) for c in children]
        assert all(p is not None and p[2] == c.pid for p, c in zip(places, children))
        reused = (*places[1][:3], str(int(places[1][3]) + 1))  # same pid, another start time
        elsewhere = ("another-boot", *places[2][1:])
        watch.places = [process_place(), places[0], reused, elsewhere]
        message = watch._end_local([1, 2, 3])
        assert children[0].wait(timeout=10) == -signal.SIGKILL
        assert message == f"; ended rank 1 (pid {children[0].pid}) on this machine with SIGKILL"
        time.sleep(0.2)
        assert children[1].poll() is None and children[2].poll() is None  # untouched
        assert watch._end_local([0]) == ""  # never itself (rank 0)
    finally:
        for c in children:
            c.kill()
            c.wait()
