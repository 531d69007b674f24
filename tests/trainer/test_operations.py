"""What an operator can rely on (README "Operating rlkit"): SIGTERM to the whole process group checkpoints and
exits, a checkpoint never runs code, a run directory is locked and never mixed with another run, metrics and
checkpoints agree after any crash, and a resume with another world size is refused."""

import os
import pickle
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import test_e2e
from test_e2e import overrides, read_jsonl, train

from rlkit.config import REPO_ROOT
from rlkit.trainer import latest_checkpoint

HERE = Path(__file__).resolve().parent
tiny = test_e2e.tiny  # the tiny model fixture


def _env():
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(REPO_ROOT), str(HERE), env.get("PYTHONPATH", "")])
    env["OMP_NUM_THREADS"] = "1"
    return env


def _steps(run_dir):
    path = Path(run_dir) / "metrics.jsonl"
    return [line["step"] for line in read_jsonl(path)] if path.exists() else []


def _group_alive(pgid):
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    return True


def test_sigterm_to_the_process_group_checkpoints_and_exits(tiny, tmp_path):
    """`timeout`, `docker stop`, Slurm and systemd signal every process of the job, reward workers too."""
    run_dir = tmp_path / "g"
    timeout_s = 5
    args = overrides(
        tiny, run_dir, "trainer.steps=500", f"reward.timeout_s={timeout_s}", "reward.num_workers=2"
    )
    log = open(tmp_path / "out.txt", "w")
    proc = subprocess.Popen(
        [sys.executable, "-m", "rlkit.train", *args], env=_env(), stdout=log, stderr=subprocess.STDOUT,
        start_new_session=True,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 300
        while max(_steps(run_dir), default=0) < 2:
            assert proc.poll() is None and time.monotonic() < deadline, (tmp_path / "out.txt").read_text()[
                -3000:
            ]
            time.sleep(0.2)
        start = time.monotonic()
        os.killpg(proc.pid, signal.SIGTERM)
        rc = proc.wait(timeout=timeout_s + 60)
        elapsed = time.monotonic() - start
    finally:
        if proc.poll() is None or _group_alive(proc.pid):
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    out = (tmp_path / "out.txt").read_text()
    assert rc == 0, out[-3000:]
    assert elapsed < timeout_s + 10, elapsed
    steps = _steps(run_dir)
    ckpt = latest_checkpoint(run_dir)
    assert ckpt is not None and int(ckpt.name.split("_")[1]) == steps[-1] < 500
    assert steps == list(range(steps[-1] + 1))  # the step-0 eval, then every step once
    for _ in range(50):  # the processes of the group are gone within seconds
        if not _group_alive(proc.pid):
            break
        time.sleep(0.1)
    left = subprocess.run(["ps", "-o", "pid,stat,args", "-g", str(proc.pid)], capture_output=True, text=True)
    assert not _group_alive(proc.pid), left.stdout  # no reward worker left behind


class _Payload:
    """Unpickling this creates a marker directory: proof that a checkpoint ran code."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return (os.mkdir, (self.marker,))


@pytest.fixture(scope="module")
def one_step_run(tiny, tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("one") / "run"
    train(tiny, run_dir, "trainer.steps=1", "trainer.eval_at_start=false")
    return run_dir


@pytest.mark.parametrize("victim", ["custom_checkpoint_0.pkl", "random_states_0.pkl", "optimizer.bin"])
def test_a_crafted_pickle_in_a_checkpoint_never_runs(tiny, one_step_run, tmp_path, victim):
    """accelerate unpickles custom_checkpoint_*.pkl with weights_only=False; rlkit writes none and refuses one."""
    from rlkit.config import load_config
    from rlkit.train import compose
    from rlkit.trainer import Trainer

    run_dir = tmp_path / "r"
    shutil.copytree(one_step_run, run_dir)
    ckpt = latest_checkpoint(run_dir)
    marker = tmp_path / "pwned"
    (ckpt / "state" / victim).write_bytes(pickle.dumps(_Payload(marker)))
    cfg = load_config(compose(overrides(tiny, run_dir, "trainer.steps=2", "trainer.resume=auto")))
    with pytest.raises(RuntimeError, match=victim if victim.startswith("custom") else "weights_only") as e:
        Trainer(cfg).close()
    assert not marker.exists()
    assert str(ckpt) in str(e.value)
