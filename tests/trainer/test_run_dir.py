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
