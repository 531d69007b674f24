"""scripts/bench.py: its arithmetic, and one --compare-trl run end to end on a tiny model."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
spec = importlib.util.spec_from_file_location("bench", REPO / "scripts" / "bench.py")
bench = importlib.util.module_from_spec(spec)
spec.loader.exec_module(bench)


def result(points):
    return {"steps": [{"step": i + 1, "seconds": t, "reward": r} for i, (t, r) in enumerate(points)]}


def test_step_seconds_median_and_mean_after_warmup():
    res = result([(10.0, 0.0), (13.0, 0.0), (17.0, 0.0), (19.0, 0.0)])
    assert bench.step_seconds(res) == [10.0, 3.0, 4.0, 2.0]
    assert bench.median([10.0, 3.0, 4.0, 2.0]) == 3.5
    assert bench.mean_after_first([10.0, 3.0, 4.0, 2.0]) == 3.0  # (3 + 4 + 2) / 3, warm-up left out


def test_time_to_reward_uses_a_full_moving_window():
    assert bench.moving_average([0.0, 0.5, 1.0, 1.0], 2) == [0.25, 0.75, 1.0]
    # 2-step moving averages: (0+0.5)/2, (0.5+1)/2 = 0.75 ending at step 3 (t=30), first to reach 0.7.
    res = result([(10, 0.0), (20, 0.5), (30, 1.0), (40, 1.0)])
    assert bench.time_to_reward(res, 0.7, window=2) == 30
    assert bench.time_to_reward(res, 1.0, window=2) == 40
    assert bench.time_to_reward(res, 1.5, window=2) is None
    # A single early step never counts as a full window: step 1 alone reaches 0.9 but the window is 2.
    assert bench.time_to_reward(result([(5, 0.9), (9, 0.0)]), 0.9, window=2) is None


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from rlkit.models import make_tiny_checkpoint

    return make_tiny_checkpoint(tmp_path_factory.mktemp("tiny"), hidden_size=32, num_layers=2, seed=0)


def test_compare_trl_runs_both_and_reports_the_ratios(tiny, tmp_path):
    pytest.importorskip("trl")
    cmd = [
        sys.executable,
        str(REPO / "scripts" / "bench.py"),
        *("--model", tiny, "--steps", "2", "--prompts", "2", "--group", "2", "--max-new-tokens", "6"),
        *("--compare-trl", "--json", "--workdir", str(tmp_path)),
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    summary = json.loads(proc.stdout)
    for name in ("rlkit", "trl"):
        assert len(summary[name]["reward_curve"]) == 2
        assert summary[name]["mean_step_s"] > 0
    assert summary["ratio_step_time"] == pytest.approx(
        summary["rlkit"]["mean_step_s"] / summary["trl"]["mean_step_s"]
    )
