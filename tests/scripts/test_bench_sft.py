"""scripts/bench_sft_trl.py end to end on a tiny model: rlkit's SFT and TRL's SFTTrainer on the same rows, seed
and settings give the same per-step loss (the untrained model's at step 1, then after each update)."""

import json
import subprocess
import sys

import pytest

from rlkit.config.schema import REPO_ROOT

pytestmark = pytest.mark.slow  # runs rlkit's SFT and TRL's SFTTrainer, each in its own process


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from rlkit.models import make_tiny_checkpoint

    return make_tiny_checkpoint(tmp_path_factory.mktemp("tiny"), hidden_size=32, num_layers=2, seed=0)


def test_rlkit_sft_loss_equals_trl_sft_trainer_step_by_step(tiny, tmp_path):
    pytest.importorskip("trl")
    cmd = [
        sys.executable, str(REPO_ROOT / "scripts" / "bench_sft_trl.py"), "--model", tiny, "--steps", "3",
        "--batch", "4", "--lr", "1e-3", "--json", "--workdir", str(tmp_path),
    ]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO_ROOT, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    summary = json.loads(proc.stdout)
    assert summary["within"] and summary["tolerance"] == 1e-3
    steps = summary["steps"]
    assert [s["step"] for s in steps] == [1, 2, 3]
    assert steps[0]["rel_diff"] < 1e-6  # the same weights on the same rows and masks
    assert steps[2]["rlkit"] < steps[0]["rlkit"]  # lr 1e-3: both learn, and alike
    assert all(s["rel_diff"] < 1e-4 for s in steps)
    assert summary["ratio_step_time"] > 0
