"""The ranks that `python -m rlkit.train trainer.num_processes=2` starts (torch's elastic launcher, rlkit/train.py's
`launch`) end with their launcher: a SIGKILLed launcher leaves no rank training on and no temp folder, and a
SIGTERM or SIGHUP to the launcher ends the run as a finished one (status 0, a checkpoint of the last step)."""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import run_helpers
from run_helpers import launch_env, launcher_folders, overrides, read_jsonl

from rlkit.checkpoints import latest_checkpoint

tiny = run_helpers.tiny  # the tiny model fixture

COLLECTIVE_TIMEOUT_S = 60
"""Also torch's shutdown timeout in `launch`: before the fix a signalled run ended only after it (SIGKILL)."""


def _children(pid):
    """Live (not zombie) processes whose parent is `pid`."""
    out = []
    for p in Path("/proc").iterdir():
        if p.name.isdigit():
            try:
                fields = (p / "stat").read_text().rsplit(")", 1)[1].split()
            except (OSError, IndexError):
                continue
            if int(fields[1]) == pid and fields[0] != "Z":
                out.append(int(p.name))
    return out


def _alive(pids):
    left = []
    for pid in pids:
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except (OSError, IndexError):
            continue
        if state != "Z":
            left.append(pid)
    return left


def _start(tiny, tmp_path):
    """A 2-process run of 500 steps, started and waited for until its first step is logged: (process, run
    directory, temp folder, the launcher's children then: the two ranks and the resource tracker)."""
    run_dir, tmp = tmp_path / "d", tmp_path / "tmp"
    tmp.mkdir()
    args = overrides(
        tiny, run_dir, "trainer.steps=500", "trainer.num_processes=2", "trainer.eval_at_start=false",
        f"trainer.collective_timeout_s={COLLECTIVE_TIMEOUT_S}",
    )  # fmt: skip
    out = open(tmp_path / "out.txt", "w")
    proc = subprocess.Popen(
        [sys.executable, "-m", "rlkit.train", *args], env=launch_env(tmp), stdout=out, stderr=subprocess.STDOUT,
        start_new_session=True,
    )  # fmt: skip
    deadline = time.monotonic() + 300
    while not (run_dir / "metrics.jsonl").exists() or not read_jsonl(run_dir / "metrics.jsonl"):
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            raise AssertionError((tmp_path / "out.txt").read_text()[-3000:])
        time.sleep(0.2)
    children = _children(proc.pid)
    assert len(children) >= 2, children  # the two ranks (and the resource tracker)
    return proc, run_dir, tmp, children


def _kill_all(proc, pids):
    for pid in [proc.pid, *pids]:
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:
            pass
    proc.wait()


def _steps_and_checkpoint(run_dir):
    steps = [m["step"] for m in read_jsonl(run_dir / "metrics.jsonl")]
    ckpt = latest_checkpoint(run_dir)
    return steps, ckpt


def test_a_sigkilled_launcher_takes_its_ranks_and_its_temp_folder_along(tiny, tmp_path):
    """Before: both ranks trained on with parent 1 (or, stopped by torch's parent-death SIGINT, waited forever
    for the dead launcher to read their result), and the launcher's `rlkit-launch-*` folder stayed."""
    proc, run_dir, tmp, children = _start(tiny, tmp_path)
    try:
        at_kill = max(m["step"] for m in read_jsonl(run_dir / "metrics.jsonl"))  # the last step logged
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
        start = time.monotonic()
        while _alive(children) and time.monotonic() - start < 45:
            time.sleep(0.2)
        left, elapsed = _alive(children), time.monotonic() - start
    finally:
        _kill_all(proc, children)
    text = (tmp_path / "out.txt").read_text()
    print(f"MEASURED launcher-sigkill-to-ranks-gone {elapsed:.1f}s")
    assert left == [], text[-3000:]
    assert "the launcher (pid" in text and "is gone: stopping this rank" in text, text[-3000:]
    assert launcher_folders(tmp) == []
    # The ranks stopped as on SIGTERM: the step they were in finished and was checkpointed; none after it. They
    # learn of the launcher's death within LAUNCHER_POLL_S (0.5 s), and a step of this tiny run can take less:
    # counted from the last step logged at the kill, not from the start (counted from the start, a run on an
    # idle machine once stopped at step 4 of 500, past the old bound of 3).
    steps, ckpt = _steps_and_checkpoint(run_dir)
    assert steps == list(range(1, steps[-1] + 1)) and steps[-1] <= at_kill + 3, (at_kill, steps)
    assert ckpt is not None and ckpt.name == f"step_{steps[-1]}"


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGHUP], ids=["sigterm", "sighup"])
def test_a_signal_to_the_launcher_ends_the_run_with_a_checkpoint_and_status_0(tiny, tmp_path, signum):
    """Before: SIGTERM to the launcher made both ranks write their checkpoint, then wait for the launcher to read
    their result until its shutdown timeout (here 60 s) SIGKILLed them, and the launcher exited 1. SIGHUP (a
    closed terminal) reached the ranks as torch's launcher passed it on, and killed them without a checkpoint."""
    proc, run_dir, tmp, children = _start(tiny, tmp_path)
    try:
        os.kill(proc.pid, signum)
        start = time.monotonic()
        try:
            rc = proc.wait(timeout=COLLECTIVE_TIMEOUT_S + 30)
        except subprocess.TimeoutExpired:
            rc = None
        elapsed = time.monotonic() - start
        time.sleep(1)
        left = _alive(children)
    finally:
        _kill_all(proc, children)
    text = (tmp_path / "out.txt").read_text()
    print(f"MEASURED launcher-signal-{int(signum)}-to-exit {elapsed:.1f}s")
    assert rc == 0, text[-3000:]
    # the ranks finish one step and a checkpoint (a few seconds here), far from the 60 s of the shutdown timeout
    assert elapsed < COLLECTIVE_TIMEOUT_S - 15, elapsed
    assert left == []
    assert f"stopped by signal {int(signum)}" in text, text[-3000:]
    steps, ckpt = _steps_and_checkpoint(run_dir)
    assert steps == list(range(1, steps[-1] + 1)) and steps[-1] < 500
    assert ckpt is not None and ckpt.name == f"step_{steps[-1]}"
    assert launcher_folders(tmp) == []
