"""One run, one directory: Hydra's `.hydra/` and log land in the run's `trainer.run_dir`, even when the
clock ticks between Hydra resolving its output dir and the job resolving `${now:...}` in `logger.name`."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from rlkit.config.schema import REPO_ROOT

# `python -m rlkit.train` with a clock that moves one second at every reading, stopping after the config is
# validated: prints the run dir the trainer would use, the run's name and Hydra's output dir.
SCRIPT = """
import json, sys
from datetime import datetime, timedelta

import hydra.core.utils


class Clock(datetime):
    t = datetime(2026, 11, 24, 3, 33, 25)

    @classmethod
    def now(cls, tz=None):
        cls.t += timedelta(seconds=1)
        return cls.t


hydra.core.utils.datetime = Clock  # what Hydra's `now` resolver reads

import rlkit.train as train
from hydra.core.hydra_config import HydraConfig
from rlkit.train import load_config


def report(cfg):
    config = load_config(cfg)
    out = HydraConfig.get().runtime.output_dir
    print(json.dumps({"run_dir": config.trainer.run_dir, "name": config.logger.name, "output_dir": out}))


train.main_from_config = report
sys.argv = ["rlkit.train", *sys.argv[1:]]
train.main()
"""


def _run(cwd, *args):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO_ROOT), os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run(
        [sys.executable, "-c", SCRIPT, *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.slow
@pytest.mark.parametrize("hydra_dir", [None, "elsewhere"])
def test_hydra_output_and_run_share_one_directory_whatever_the_clock(tmp_path, hydra_dir):
    args = ["+recipe=quickstart_1digit", "logger=none"]
    if hydra_dir is not None:  # `hydra.run.dir` set on the command line: the run goes there too
        args.append(f"hydra.run.dir={hydra_dir}")
    got = _run(tmp_path, *args)
    run_dir = (tmp_path / got["run_dir"]).resolve()
    assert run_dir == Path(got["output_dir"]).resolve()  # before the fix: one second later
    assert (run_dir / ".hydra" / "config.yaml").is_file() and (run_dir / "train.log").is_file()
    if hydra_dir is None:
        assert got["name"].startswith("quickstart-20261124-0333")  # the mocked clock
        assert [p.name for p in (tmp_path / "runs").iterdir()] == [got["name"]]
    else:
        assert run_dir == (tmp_path / hydra_dir).resolve()


def test_a_resume_cuts_samples_jsonl_back_with_metrics_jsonl(tmp_path):
    """trainer.log_samples rows of the steps a resumed run redoes are dropped, as their metrics lines are."""
    import json

    from rlkit.rundir import SAMPLES_FILE, truncate_metrics

    rows = [{"step": s, "kind": k, "reward": 0.5} for s in range(4) for k in ("train", "eval")]
    (tmp_path / SAMPLES_FILE).write_text("".join(json.dumps(r) + "\n" for r in rows) + '{"step": 4, "tor')
    truncate_metrics(tmp_path, 2)
    kept = [json.loads(line) for line in (tmp_path / SAMPLES_FILE).read_text().splitlines()]
    assert [r["step"] for r in kept] == [0, 0, 1, 1, 2, 2]


def _train(tmp_path, *args, env=None):
    env = dict(
        env or os.environ, PYTHONPATH=os.pathsep.join([str(REPO_ROOT), os.environ.get("PYTHONPATH", "")])
    )
    return subprocess.run(
        [sys.executable, "-m", "rlkit.train", "+recipe=quickstart_1digit", "logger=none", "trainer.steps=1", *args],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip


@pytest.mark.slow  # a `python -m rlkit.train` launch
def test_a_second_run_in_a_held_run_dir_is_refused_before_hydra_writes_there(tmp_path):
    """The lock is taken in Hydra's on_run_start callback (rlkit.train.RunDirGuard), before Hydra saves
    `.hydra/config.yaml` and opens `train.log`. Before: the second run was refused by the trainer, after Hydra
    had replaced the first run's `.hydra/config.yaml` and written into its `train.log`."""
    run_dir = tmp_path / "held"
    (run_dir / ".hydra").mkdir(parents=True)
    files = {
        run_dir / ".hydra" / "config.yaml": "the first run's config\n",
        run_dir / "train.log": "first log\n",
    }
    for path, text in files.items():
        path.write_text(text)
    holder = subprocess.Popen(
        [sys.executable, "-c", f"import time; from rlkit.rundir import RunDirLock; lock = RunDirLock({str(run_dir)!r}); "
         "print('locked', flush=True); time.sleep(600)"],
        env=dict(os.environ, PYTHONPATH=str(REPO_ROOT)), stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        assert holder.stdout.readline().strip() == "locked"
        proc = _train(tmp_path, f"trainer.run_dir={run_dir}")
    finally:
        holder.kill()
        holder.wait()
    assert proc.returncode != 0
    assert f"is in use by another rlkit run (pid {holder.pid}" in proc.stderr + proc.stdout, proc.stderr[
        -3000:
    ]
    assert {path: path.read_text() for path in files} == files
    assert sorted(p.name for p in (run_dir / ".hydra").iterdir()) == ["config.yaml"]


@pytest.mark.slow  # a `python -m rlkit.train` launch
def test_a_symlinked_train_log_is_refused_before_hydra_writes_through_it(tmp_path):
    """Hydra's log file (and every file rlkit writes in the run directory) is checked before Hydra opens it.
    Before: Hydra appended the run's log to the symlink's target."""
    victim = tmp_path / "precious.txt"
    victim.write_text("precious\n")
    run_dir = tmp_path / "hostile"
    run_dir.mkdir()
    (run_dir / "train.log").symlink_to(victim)
    proc = _train(tmp_path, f"trainer.run_dir={run_dir}")
    assert proc.returncode != 0
    assert f"{run_dir / 'train.log'} is a symlink" in proc.stderr + proc.stdout, proc.stderr[-3000:]
    assert victim.read_text() == "precious\n"
    assert not (run_dir / ".hydra").exists()
