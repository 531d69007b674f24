"""The wheel stands alone: built from the checkout and installed (not editable) into a fresh virtualenv, it
composes `+recipe=quickstart` and trains one step from an empty folder, with the configs and recipes it
ships, and a user's own recipe joins through Hydra's searchpath.

The fresh venv borrows this environment's packages (torch, transformers, ...) through a `.pth` line naming
its site-packages, so nothing is downloaded; such a line adds the folder to sys.path without running the
`.pth` hooks in it, so the editable install of rlkit there is not importable (checked before the wheel)."""

import os
import shutil
import site
import subprocess
import sys
from pathlib import Path

import pytest

from rlkit.config.schema import REPO_ROOT

pytestmark = pytest.mark.slow  # builds and installs the wheel in a new venv: `make test-fast` leaves it out

# What the wheel is built from (copied, so that the build leaves no build/ or egg-info in the checkout).
SOURCES = ["pyproject.toml", "setup.py", "README.md", "LICENSE", "rlkit", "configs", "recipes"]

# The user's recipe: extends a recipe of the package and changes one key.
MY_RECIPE = """# @package _global_
defaults:
  - quickstart_1digit
  - _self_
trainer:
  steps: 7
"""


def _run(cmd, cwd, timeout=120):
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}  # nothing but the venv's own sys.path
    env["OMP_NUM_THREADS"] = "1"
    proc = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    return proc


def _ok(proc):
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    return proc.stdout


def test_wheel_installs_alone_and_trains_from_any_folder(tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    for name in SOURCES:
        if (REPO_ROOT / name).is_dir():
            shutil.copytree(REPO_ROOT / name, src / name, ignore=shutil.ignore_patterns("__pycache__"))
        else:
            shutil.copy2(REPO_ROOT / name, src / name)
    dist = tmp_path / "dist"
    pip = [sys.executable, "-m", "pip", "--disable-pip-version-check"]
    _ok(_run([*pip, "wheel", "-q", "--no-deps", "--no-build-isolation", "-w", dist, src], tmp_path))
    (wheel,) = dist.glob("rlkit-*.whl")

    venv = tmp_path / "venv"
    _ok(_run([sys.executable, "-m", "venv", "--without-pip", venv], tmp_path))
    python = str(venv / "bin" / "python")
    purelib = Path(
        _ok(_run([python, "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"], tmp_path)).strip()
    )
    (purelib / "borrowed.pth").write_text("\n".join(site.getsitepackages()) + "\n")

    empty = tmp_path / "empty"
    empty.mkdir()
    before = _run([python, "-c", "import torch, hydra; import rlkit"], empty)
    assert before.returncode != 0 and "No module named 'rlkit'" in before.stderr, before.stderr[-2000:]

    # --ignore-installed: never touch the rlkit installed in the borrowed environment
    _ok(_run([python, "-m", "pip", "install", "-q", "--no-deps", "--ignore-installed", wheel], empty))
    where = _ok(
        _run([python, "-c", "import rlkit.config.schema as c; print(c.__file__); print(c.CONFIG_DIR)"], empty)
    )
    module, config_dir = where.split()
    assert Path(module).is_relative_to(purelib) and Path(config_dir) == purelib / "rlkit" / "configs"

    train = [python, "-m", "rlkit.train"]
    job = _ok(_run([*train, "+recipe=quickstart", "--cfg", "job"], empty))
    assert "path: arithmetic" in job and "plain_add2" in job

    # A recipe of the user's, beside the package's: Hydra's searchpath, group folder `recipe/`.
    (empty / "my_confs" / "recipe").mkdir(parents=True)
    (empty / "my_confs" / "recipe" / "mine.yaml").write_text(MY_RECIPE)
    mine = _ok(_run([*train, "+recipe=mine", "hydra.searchpath=[file://my_confs]", "--cfg", "job"], empty))
    assert "steps: 7" in mine and "path: arithmetic" in mine

    # One step on a tiny random model (HF engine), from the empty folder.
    from rlkit.models import make_tiny_checkpoint

    tiny = make_tiny_checkpoint(tmp_path / "tiny", hidden_size=32, num_layers=2, seed=0)
    run_dir = tmp_path / "run"
    step = [
        "+recipe=quickstart_1digit", f"model.path={tiny}", f"trainer.run_dir={run_dir}", "trainer.steps=1",
        "trainer.train_batch_size=8", "rollout.group_size=4", "rollout.max_new_tokens=8", "rollout.engine=hf",
        "data.eval_size=4", "data.num_train=16", "data.num_eval=4", "trainer.eval_every=0",
        "trainer.save_every=0", "trainer.progress_bar=false", "reward.num_workers=1", "logger=none",
    ]  # fmt: skip
    _ok(_run([*train, *step], empty, timeout=300))
    assert '"step": 1' in (run_dir / "metrics.jsonl").read_text()
    assert (run_dir / ".hydra" / "config.yaml").is_file()
    assert sorted(p.name for p in empty.iterdir()) == ["my_confs"]  # nothing written to the launch folder
