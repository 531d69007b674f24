"""`python -m rlkit.sft` launched as users launch it: a run SIGKILLed mid-way resumes exactly (its losses and final
weights are an uninterrupted run's), and two processes train as one does (issue 60's "Done when")."""

import os
import signal
import subprocess
import sys
import time

import pytest
import torch
from run_helpers import checkpoint_weights, launch_env, read_jsonl
from test_sft_run import model_dir, run_sft, sft_overrides  # noqa: F401  (model_dir: the tiny model fixture)

pytestmark = pytest.mark.slow  # launched SFT runs

STEPS = 40
LONG = (f"trainer.steps={STEPS}", "trainer.save_every=4", "trainer.eval_every=0", "data.num_train=256")


def _launch(model, run_dir, *extra, tmp=None):
    args = [sys.executable, "-m", "rlkit.sft", *sft_overrides(model, run_dir, *extra)]
    return subprocess.Popen(
        args, env=launch_env(tmp), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )


def _losses(run_dir):
    return {line["step"]: line["loss"] for line in read_jsonl(run_dir / "metrics.jsonl") if "loss" in line}


def test_a_run_sigkilled_mid_way_resumes_exactly(model_dir, tmp_path):  # noqa: F811
    straight = tmp_path / "straight"
    run_sft(model_dir, straight, *LONG)  # in this process, one thread: as the launched runs sum
    killed = tmp_path / "killed"
    proc = _launch(model_dir, killed, *LONG, tmp=tmp_path)
    ckpts = killed / "checkpoints"
    deadline = time.monotonic() + 600
    while not (ckpts / "step_8").is_dir():  # two checkpoints in: kill it where it stands
        assert proc.poll() is None, proc.stdout.read()[-3000:]
        assert time.monotonic() < deadline, "no checkpoint step_8 within 600 s"
        time.sleep(0.02)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    stopped_at = max(_losses(killed))
    assert stopped_at < STEPS, "the run finished before the kill: nothing was resumed"
    resumed = _launch(model_dir, killed, *LONG, tmp=tmp_path)
    out, _ = resumed.communicate(timeout=900)
    assert resumed.returncode == 0, out[-3000:]
    assert _losses(killed) == _losses(straight)  # every step once, each the uninterrupted run's, bit for bit
    want = checkpoint_weights(straight / "checkpoints" / f"step_{STEPS}")
    got = checkpoint_weights(killed / "checkpoints" / f"step_{STEPS}")
    assert want.keys() == got.keys() and all(torch.equal(want[k], got[k]) for k in want)


@pytest.mark.parametrize("strategy", ["fsdp2"])
def test_two_processes_train_as_one(model_dir, tmp_path, strategy):  # noqa: F811
    """The loss is a token-level mean over the global batch: split across two ranks, each step's loss and the
    final weights are one process's up to float summation order."""
    short = ("trainer.steps=3", "trainer.save_every=0", "trainer.eval_every=0")
    one = tmp_path / "one"
    run_sft(model_dir, one, *short)
    two = tmp_path / "two"
    proc = _launch(
        model_dir, two, *short, "trainer.num_processes=2", f"trainer.strategy={strategy}", tmp=tmp_path
    )
    out, _ = proc.communicate(timeout=900)
    assert proc.returncode == 0, out[-3000:]
    a, b = _losses(one), _losses(two)
    assert a.keys() == b.keys() == {1, 2, 3}
    for step in a:
        assert b[step] == pytest.approx(a[step], rel=1e-5, abs=1e-6), step
    want, got = (
        checkpoint_weights(one / "checkpoints" / "step_3"),
        checkpoint_weights(two / "checkpoints" / "step_3"),
    )
    assert want.keys() == got.keys()
    assert max(float((want[k] - got[k]).abs().max()) for k in want) < 1e-4
