"""What the tests that run the trainer share: the tiny model, the tiny run's overrides, `train`, launching
`python -m rlkit.train` as a user does, reading metrics and checkpoints back."""

import contextlib
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import torch
from cfg_helpers import as_in_cpu_ci

from rlkit.config.schema import REPO_ROOT
from rlkit.train import compose, load_config
from rlkit.trainer import run

FIXTURES = Path(__file__).resolve().parent / "fixtures"
"""Test reward functions and environments (rlkit_test_*.py), imported by name in worker processes: on sys.path
(tests/conftest.py), and on PYTHONPATH for launched subprocesses."""


@pytest.fixture(scope="session")
def tiny(tmp_path_factory):
    from rlkit.models import make_tiny_checkpoint

    torch.manual_seed(0)
    return make_tiny_checkpoint(tmp_path_factory.mktemp("tiny"), hidden_size=32, num_layers=2, seed=0)


def overrides(tiny, run_dir, *extra):
    """The tiny run's overrides (on a machine with CUDA, as in CPU CI: cfg_helpers.as_in_cpu_ci)."""
    return as_in_cpu_ci(
        [
            "+recipe=quickstart_1digit",
            f"model.path={tiny}",
            f"trainer.run_dir={run_dir}",
            "trainer.steps=2",
            "trainer.train_batch_size=8",
            "rollout.group_size=4",
            "rollout.max_new_tokens=12",
            "data.eval_size=4",
            "data.num_train=64",
            "data.num_eval=8",
            "trainer.eval_every=0",
            "trainer.save_every=0",
            "trainer.lr=1e-3",
            "trainer.progress_bar=false",
            # matplotlib's import and drawing cost ~2 s a run; test_e2e's wandb test draws the curves
            "trainer.curves=false",
            # A response-dependent reward, so the random model gets non-zero advantages.
            "reward.fn=rlkit_test_rewards:length",
            "reward.num_workers=1",
            "algo.mask_zero_std_groups=false",
            "logger=none",
            *extra,
        ]
    )


def train(tiny, run_dir, *extra, reward_extra=None):
    cfg = load_config(compose(overrides(tiny, run_dir, *extra)))
    if reward_extra is not None:  # import paths do not fit Hydra's dict-key grammar
        cfg.reward.extra = reward_extra
    return run(cfg)


def run_args(args: list[str]):
    """`python -m rlkit.train ARGS` in this process, with one thread, as the launched runs (`launch` sets
    OMP_NUM_THREADS=1), so an in-process run and a launched one sum in the same order: its step metrics."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return run(load_config(compose(args)))
    finally:
        torch.set_num_threads(threads)


def read_jsonl(path):
    return [json.loads(line) for line in Path(path).read_text().splitlines()]


def weights_dir(path):
    """Every tensor of the safetensors files in an HF model directory."""
    from safetensors.torch import load_file

    out = {}
    for f in sorted(Path(path).glob("*.safetensors")):
        out.update(load_file(f))
    return out


def checkpoint_weights(ckpt):
    """Every tensor of a checkpoint's HF model."""
    return weights_dir(ckpt / "model")


def launch_env(tmpdir=None) -> dict:
    """The environment of a launched `python -m rlkit.train`: rlkit and the test fixtures importable, one
    thread per process (a random model's near-uniform sampling is sensitive to the summation order of its
    softmax, which depends on the number of threads), and `tmpdir` as its temp folder (TMPDIR) if given."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(REPO_ROOT), str(FIXTURES), env.get("PYTHONPATH", "")])
    env["OMP_NUM_THREADS"] = "1"
    if tmpdir is not None:
        env["TMPDIR"] = str(tmpdir)
    return env


def launcher_folders(tmpdir) -> list[str]:
    """The folders torch's launcher left in `tmpdir` (it leaves one unless rlkit names one it removes:
    rlkit/train.py::launch)."""
    return [p.name for p in Path(tmpdir).iterdir() if p.name.startswith(("torchelastic_", "rlkit-launch-"))]


def start(*args, cwd=REPO_ROOT) -> subprocess.Popen:
    """`python -m rlkit.train ARGS` started from `cwd` as `launch` does, not waited for: its output goes to a file
    (a pipe nobody reads while the test does other work would fill), which `finish` reads."""
    env = launch_env()
    output = tempfile.TemporaryFile("w+")
    proc = subprocess.Popen(
        [sys.executable, "-m", "rlkit.train", *args], cwd=cwd, env=env, text=True, stdout=output,
        stderr=subprocess.STDOUT,
    )  # fmt: skip
    proc.output = output
    return proc


def finish(proc: subprocess.Popen, timeout=900) -> str | None:
    """Wait for a `start`ed run: None if it succeeded, else its output (the last 9000 characters)."""
    proc.wait(timeout=timeout)
    proc.output.seek(0)
    text = proc.output.read()
    proc.output.close()
    return None if proc.returncode == 0 else text[-9000:]


def launch(cwd, *args, timeout=600, tmpdir=None):
    """`python -m rlkit.train ARGS` in a subprocess from `cwd`, as a user launches it; asserts it succeeds.
    `tmpdir`: its temp folder (TMPDIR)."""
    env = launch_env(tmpdir)
    proc = subprocess.run(
        [sys.executable, "-m", "rlkit.train", *args],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    return proc


def one_and_two_processes(tmp_path, common, keys, extra) -> dict[int, Path]:
    """Launch the overrides `common` (+ `extra[n]`) with 1 and with 2 processes, assert that the `keys` of their
    2 steps agree (rel 1e-4) and return {n: run directory}."""
    runs, tmp = {}, tmp_path / "tmp"
    tmp.mkdir()
    for n in (1, 2):
        run_dir = tmp_path / f"np{n}"
        args = [o if not o.startswith("trainer.run_dir") else f"trainer.run_dir={run_dir}" for o in common]
        launch(tmp_path, *args, f"trainer.num_processes={n}", *extra[n], tmpdir=tmp)
        runs[n] = run_dir
    assert launcher_folders(tmp) == []
    m1, m2 = read_jsonl(runs[1] / "metrics.jsonl")[1:], read_jsonl(runs[2] / "metrics.jsonl")[1:]
    assert len(m1) == len(m2) == 2
    for a, b in zip(m1, m2):
        for k in keys:
            assert b[k] == pytest.approx(a[k], rel=1e-4, abs=1e-6), k
    return runs


@contextlib.contextmanager
def read_only(folder: Path):
    """`folder` (created) made unwritable: a read-only tmpfs mounted on it (CI runs as root, whom permission
    bits do not stop), or without mount rights no write bits; skips the test where neither holds."""
    folder.mkdir(parents=True, exist_ok=True)
    try:
        mounted = (
            subprocess.run(["mount", "-t", "tmpfs", "-o", "ro,size=1m", "tmpfs", str(folder)]).returncode == 0
        )
    except OSError:
        mounted = False
    if not mounted:
        if os.geteuid() == 0:
            pytest.skip("mount -t tmpfs is not allowed here and root ignores permission bits")
        folder.chmod(0o555)
    try:
        yield folder
    finally:
        if mounted:
            subprocess.run(["umount", "-l", str(folder)], check=False)
        else:
            folder.chmod(0o755)
