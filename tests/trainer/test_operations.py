"""What an operator can rely on (README "Operating rlkit"): SIGTERM to the whole process group checkpoints and
exits, a checkpoint never runs code, a run directory is locked and never mixed with another run, metrics and
checkpoints agree after any crash, and a resume with another world size is refused."""

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import run_helpers
import torch
from run_helpers import launch_env, overrides, read_jsonl, run_args, train

from rlkit.checkpoints import latest_checkpoint, write_checksums

pytestmark = pytest.mark.slow  # launched trainer runs: `make test-fast` leaves it out

tiny = run_helpers.tiny  # the tiny model fixture


def _steps(run_dir):
    path = Path(run_dir) / "metrics.jsonl"
    return [line["step"] for line in read_jsonl(path)] if path.exists() else []


def _group_alive(pgid):
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    return True


def _running(pid):
    """Alive and not a zombie (a worker killed by the signal stays a zombie until the trainer reaps it)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def _pids(log):
    return [int(line) for line in log.read_text().split()] if log.exists() else []


def test_sigterm_to_the_process_group_checkpoints_and_exits(tiny, tmp_path):
    """`timeout`, `docker stop`, Slurm and systemd signal every process of the job, reward workers too. The
    signal arrives while a reward worker is busy: the worker ignores it (same pid, no replacement), the step
    finishes with intact rewards, equal to those of a run that was never signalled."""
    run_dir = tmp_path / "g"
    timeout_s = 5
    reward = (
        "reward.fn=rlkit_test_rewards:slow_length",
        f"reward.timeout_s={timeout_s}",
        "reward.num_workers=2",
        "data.eval_size=0",  # no evaluation: every slow reward call is a step's
    )
    reward_log = tmp_path / "reward_pids"
    env = {**launch_env(), "RLKIT_TEST_REWARD_LOG": str(reward_log)}
    log = open(tmp_path / "out.txt", "w")
    proc = subprocess.Popen(
        [sys.executable, "-m", "rlkit.train", *overrides(tiny, run_dir, "trainer.steps=500", *reward)],
        env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 300
        while max(_steps(run_dir), default=0) < 2:
            assert proc.poll() is None and time.monotonic() < deadline, (tmp_path / "out.txt").read_text()[
                -3000:
            ]
            time.sleep(0.2)
        calls = len(_pids(reward_log))
        while len(_pids(reward_log)) == calls:  # wait for a reward call to start: its worker sleeps 0.5 s
            assert proc.poll() is None and time.monotonic() < deadline
            time.sleep(0.01)
        workers = set(_pids(reward_log))
        start = time.monotonic()
        os.killpg(proc.pid, signal.SIGTERM)
        time.sleep(0.1)  # the busy call has 0.4 s left: the step is not over, no worker is closed yet
        survived = {p: _running(p) for p in workers}
        rc = proc.wait(timeout=timeout_s + 60)
        elapsed = time.monotonic() - start
    finally:
        if proc.poll() is None or _group_alive(proc.pid):
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    out = (tmp_path / "out.txt").read_text()
    print(f"MEASURED sigterm-to-exit {elapsed:.1f}s (reward.timeout_s={timeout_s})")
    assert rc == 0, out[-3000:]
    assert len(workers) == 2 and all(survived.values()), survived  # the signal killed no reward worker
    assert set(_pids(reward_log)) == workers  # and no replacement worker scored anything after it
    assert elapsed < timeout_s + 10, elapsed
    steps = _steps(run_dir)
    ckpt = latest_checkpoint(run_dir)
    assert ckpt is not None and int(ckpt.name.split("_")[1]) == steps[-1] < 500
    assert steps == list(range(1, steps[-1] + 1))  # every step once
    for _ in range(50):  # the processes of the group are gone within seconds
        if not _group_alive(proc.pid):
            break
        time.sleep(0.1)
    left = subprocess.run(["ps", "-o", "pid,stat,args", "-g", str(proc.pid)], capture_output=True, text=True)
    assert not _group_alive(proc.pid), left.stdout  # no reward worker left behind
    # The signalled step scored every sample, and every step equals the same run never signalled.
    signalled = read_jsonl(run_dir / "metrics.jsonl")
    assert signalled[-1]["reward/errors"] == 0 and signalled[-1]["reward/timeouts"] == 0
    straight_dir = tmp_path / "straight"
    # in this process, with one thread as the launch
    run_args(overrides(tiny, straight_dir, f"trainer.steps={steps[-1]}", *reward))
    straight = read_jsonl(straight_dir / "metrics.jsonl")
    assert [m["step"] for m in straight] == steps
    for want, got in zip(straight[1:], signalled[1:]):
        for key in ("reward/mean", "reward/std", "reward/max", "reward/errors", "response_length/mean"):
            assert got[key] == pytest.approx(want[key], rel=1e-6, abs=1e-9), (got["step"], key)


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
    from rlkit.train import compose, load_config
    from rlkit.trainer import Trainer

    run_dir = tmp_path / "r"
    shutil.copytree(one_step_run, run_dir)
    ckpt = latest_checkpoint(run_dir)
    marker = tmp_path / "pwned"
    torch.save({"state": _Payload(marker)}, ckpt / "state" / victim)  # as accelerate writes its files
    write_checksums(ckpt)  # checksums.json is not a signature: whoever can plant a file can rewrite it
    cfg = load_config(compose(overrides(tiny, run_dir, "trainer.steps=2", "trainer.resume=auto")))
    with pytest.raises(RuntimeError, match=victim if victim.startswith("custom") else "weights_only") as e:
        Trainer(cfg).close()
    assert not marker.exists()
    assert str(ckpt) in str(e.value)


def _config(tiny, run_dir, *extra):
    from rlkit.train import compose, load_config

    return load_config(compose(overrides(tiny, run_dir, *extra)))


def test_a_second_run_in_a_locked_run_dir_is_refused_and_a_dead_holder_frees_it(tiny, one_step_run, tmp_path):
    from rlkit.trainer import Trainer

    run_dir = tmp_path / "r"
    shutil.copytree(one_step_run, run_dir)
    first = Trainer(_config(tiny, run_dir, "trainer.steps=2"))
    try:
        with pytest.raises(RuntimeError, match=rf"run_dir={run_dir} is in use .*pid {os.getpid()}"):
            train(tiny, run_dir, "trainer.steps=2")
    finally:
        first.close()
    # A holder killed with SIGKILL (no clean-up at all) frees the directory: the kernel drops its lock.
    holder = subprocess.Popen(
        [sys.executable, "-c", f"import time; from rlkit.rundir import RunDirLock; lock = RunDirLock({str(run_dir)!r}); "
         "print('locked', flush=True); time.sleep(600)"],
        env=launch_env(), stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        assert holder.stdout.readline().strip() == "locked"
        with pytest.raises(RuntimeError, match=f"pid {holder.pid}"):
            train(tiny, run_dir, "trainer.steps=2")
    finally:
        holder.kill()
        holder.wait()
    from rlkit.rundir import RunDirLock

    RunDirLock(run_dir).release()  # free again


def test_resume_none_in_a_used_run_dir_is_refused_and_leaves_it_untouched(tiny, one_step_run, tmp_path):
    run_dir = tmp_path / "r"
    shutil.copytree(one_step_run, run_dir)

    def files():  # every file but the lock, with its modification time
        return {
            p.relative_to(run_dir): p.stat().st_mtime_ns for p in run_dir.rglob("*") if p.name != "rlkit.lock"
        }

    before = files()
    with pytest.raises(
        RuntimeError, match=r"resume=none.*checkpoints/step_1.*new trainer.run_dir.*resume=auto"
    ):
        train(tiny, run_dir, "trainer.steps=2", "trainer.resume=none")
    assert files() == before


@pytest.mark.parametrize(
    ("extra", "key", "saved", "new"),
    [
        (("rollout.group_size=2",), "rollout.group_size", "4", "2"),
        (("algo.adv_estimator=gae", "algo.value_model=true"), "algo.adv_estimator", "'grpo'", "'gae'"),
    ],
)
def test_resume_with_another_run_key_is_refused_naming_both_before_models_load(
    tiny, one_step_run, tmp_path, monkeypatch, extra, key, saved, new
):
    """The checkpoint records the keys a resume must keep (rlkit.checkpoints.RESUME_KEYS). Before: another group
    size resumed silently, and a critic the checkpoint lacks failed with a bare FileNotFoundError after the
    models loaded."""
    import rlkit.trainer

    run_dir = tmp_path / "r"
    shutil.copytree(one_step_run, run_dir)
    recorded = json.loads((latest_checkpoint(run_dir) / "trainer_state.json").read_text())["resume_keys"]
    assert recorded["rollout.group_size"] == 4 and recorded["model.path"] == str(tiny)
    assert (
        recorded["model.shape"]["hidden_size"]
        == json.loads((Path(tiny) / "config.json").read_text())["hidden_size"]
    )
    cfg = _config(tiny, run_dir, "trainer.steps=2", *extra)

    def no_model(*args, **kwargs):
        raise AssertionError("a model loaded before the resume was checked")

    monkeypatch.setattr(rlkit.trainer, "Learner", no_model)
    monkeypatch.setattr(rlkit.trainer, "load_tokenizer", no_model)
    with pytest.raises(
        RuntimeError, match=rf"{key} was {saved} in the run that wrote it, this run has {new}"
    ):
        rlkit.trainer.Trainer(cfg)
    from rlkit.rundir import RunDirLock

    RunDirLock(run_dir).release()  # the refused run left the directory free


def test_resume_with_another_world_size_is_refused_naming_both(tiny, one_step_run, tmp_path):
    run_dir = tmp_path / "r"
    shutil.copytree(one_step_run, run_dir)
    state = latest_checkpoint(run_dir) / "trainer_state.json"
    assert json.loads(state.read_text())["world_size"] == 1
    # As a 2-process run would have written it (every other file is the same kind of file).
    state.write_text(json.dumps({**json.loads(state.read_text()), "world_size": 2}))
    write_checksums(state.parent)
    with pytest.raises(RuntimeError, match="written by 2 processes, this run has 1"):
        train(tiny, run_dir, "trainer.steps=2")


def test_crash_right_after_a_checkpoint_loses_no_metrics_line(tiny, tmp_path, monkeypatch):
    from rlkit.trainer import Trainer

    real_save = Trainer.save_checkpoint

    def save_then_crash(self):
        path = real_save(self)
        if self.global_step == 1:
            raise RuntimeError("killed right after the checkpoint (simulated)")
        return path

    monkeypatch.setattr(Trainer, "save_checkpoint", save_then_crash)
    with pytest.raises(RuntimeError, match="simulated"):
        train(tiny, tmp_path / "r", "trainer.steps=2", "trainer.save_every=1")
    monkeypatch.setattr(Trainer, "save_checkpoint", real_save)
    assert latest_checkpoint(tmp_path / "r").name == "step_1"
    train(tiny, tmp_path / "r", "trainer.steps=2", "trainer.save_every=1")
    assert _steps(tmp_path / "r") == [0, 1, 2]


def test_crash_between_checkpoints_duplicates_no_metrics_line(tiny, tmp_path, monkeypatch):
    """save_every=2: a crash in step 4 leaves the line of step 3, which is past the checkpoint (step 2); the
    resumed run cuts it off (and a line torn by the crash) and redoes step 3 identically."""
    from rlkit.trainer import Trainer

    real_step = Trainer.train_step

    def crash_in_step_4(self):
        if self.global_step == 3:
            raise RuntimeError("crash in step 4 (simulated)")
        return real_step(self)

    run_dir = tmp_path / "r"
    monkeypatch.setattr(Trainer, "train_step", crash_in_step_4)
    with pytest.raises(RuntimeError, match="simulated"):
        train(tiny, run_dir, "trainer.steps=4", "trainer.save_every=2")
    monkeypatch.setattr(Trainer, "train_step", real_step)
    first = read_jsonl(run_dir / "metrics.jsonl")
    assert [m["step"] for m in first] == [0, 1, 2, 3] and latest_checkpoint(run_dir).name == "step_2"
    with open(run_dir / "metrics.jsonl", "a") as f:
        f.write('{"step": 4, "reward/me')  # a line cut short by kill -9
    train(tiny, run_dir, "trainer.steps=4", "trainer.save_every=2")
    lines = read_jsonl(run_dir / "metrics.jsonl")
    assert [m["step"] for m in lines] == [0, 1, 2, 3, 4]
    for key in ("reward/mean", "loss/total", "grad_norm"):
        assert lines[3][key] == pytest.approx(first[3][key], rel=1e-6, abs=1e-9), key
