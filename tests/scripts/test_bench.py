"""scripts/bench.py: its arithmetic (scripts/bench_report.py), and one --compare-trl run end to end on a tiny
model."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # runs the benchmark scripts (trainer steps): `make test-fast` leaves it out

REPO = Path(__file__).resolve().parents[2]
spec = importlib.util.spec_from_file_location("bench_report", REPO / "scripts" / "bench_report.py")
bench_report = importlib.util.module_from_spec(spec)
spec.loader.exec_module(bench_report)


def result(points):
    return {"steps": [{"step": i + 1, "seconds": t, "reward": r} for i, (t, r) in enumerate(points)]}


def test_step_seconds_median_and_mean_after_warmup():
    res = result([(10.0, 0.0), (13.0, 0.0), (17.0, 0.0), (19.0, 0.0)])
    assert bench_report.step_seconds(res) == [10.0, 3.0, 4.0, 2.0]
    assert bench_report.median([10.0, 3.0, 4.0, 2.0]) == 3.5
    assert bench_report.mean_after_first([10.0, 3.0, 4.0, 2.0]) == 3.0  # (3 + 4 + 2) / 3, warm-up left out


def test_time_to_reward_uses_a_full_moving_window():
    assert bench_report.moving_average([0.0, 0.5, 1.0, 1.0], 2) == [0.25, 0.75, 1.0]
    # 2-step moving averages: (0+0.5)/2, (0.5+1)/2 = 0.75 ending at step 3 (t=30), first to reach 0.7.
    res = result([(10, 0.0), (20, 0.5), (30, 1.0), (40, 1.0)])
    assert bench_report.time_to_reward(res, 0.7, window=2) == 30
    assert bench_report.time_to_reward(res, 1.0, window=2) == 40
    assert bench_report.time_to_reward(res, 1.5, window=2) is None
    # A single early step never counts as a full window: step 1 alone reaches 0.9 but the window is 2.
    assert bench_report.time_to_reward(result([(5, 0.9), (9, 0.0)]), 0.9, window=2) is None


def counted(seed, rows):
    """A run whose steps are (end seconds, reward, generated tokens, generate s, learner tokens, learner s)."""
    keys = ("seconds", "reward", "gen_tokens", "gen_s", "learner_tokens", "learner_s")
    return {"seed": seed, "steps": [{"step": i + 1, **dict(zip(keys, r))} for i, r in enumerate(rows)]}


def test_throughput_pools_seeds_as_ratios_of_sums_after_warmup():
    # Step 1 of each seed (the huge numbers) is warm-up and left out.
    a = counted(0, [(50, 0, 999, 9, 999, 9), (53, 0, 100, 1.0, 300, 2.0), (57, 0, 100, 3.0, 300, 1.0)])
    b = counted(1, [(40, 0, 999, 9, 999, 9), (42, 0, 200, 1.0, 600, 3.0)])
    t = bench_report.throughput([a, b])
    assert t["steps"] == 3
    assert t["mean_step_s"] == pytest.approx((3 + 4 + 2) / 3)
    assert t["gen_tokens_per_step"] == pytest.approx(400 / 3)
    assert t["gen_tokens_per_s"] == pytest.approx(400 / 5.0)  # not the mean of 100, 33.3 and 200
    assert t["learner_tokens_per_s"] == pytest.approx(1200 / 6.0)
    assert t["learner_s_per_step"] == pytest.approx(2.0)


def test_learning_level_is_the_median_of_trl_seeds_and_never_counts_as_late():
    flat = [(10, 0.0), (20, 0.0), (30, 0.0)]
    trl = [result([(10, 0.2), (20, 0.4), (30, 0.4)]), result([(10, 0.0), (20, 0.6), (30, 0.6)]), result(flat)]
    rl = [result([(5, 0.3), (9, 0.5), (12, 0.5)]), result(flat), result(flat)]
    for i, run in enumerate(trl + rl):
        run["seed"] = i % 3
    table = bench_report.learning({"rlkit": rl, "trl": trl}, None, 2)
    # Best 2-step means of TRL's seeds: 0.4, 0.6, 0.0; their median is 0.4, first reached at the end of
    # step 3 by seeds 0 and 1 (their windows ending at step 2 are (0.2+0.4)/2 and (0+0.6)/2 = 0.3).
    assert table["reward_level"] == pytest.approx(0.4)
    assert table["trl"]["time_to_level_s"] == [30, 30, None] and table["trl"]["median_s"] == 30
    assert table["rlkit"]["time_to_level_s"] == [9, None, None] and table["rlkit"]["reached"] == "1/3"
    assert table["rlkit"]["median_s"] is None and table["ratio_median_time_to_level"] is None
    assert bench_report.learning({"rlkit": rl}, 0.5, 2)["rlkit"]["time_to_level_s"] == [12, None, None]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from rlkit.models import make_tiny_checkpoint

    return make_tiny_checkpoint(tmp_path_factory.mktemp("tiny"), hidden_size=32, num_layers=2, seed=0)


def run_bench(tiny, tmp_path, *extra):
    cmd = [
        sys.executable,
        str(REPO / "scripts" / "bench.py"),
        *("--model", tiny, "--steps", "2", "--prompts", "2", "--group", "2", "--max-new-tokens", "6"),
        *("--compare-trl", "--json", "--workdir", str(tmp_path), *extra),
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    return json.loads(proc.stdout)


def test_compare_trl_runs_both_and_reports_the_ratios(tiny, tmp_path):
    pytest.importorskip("trl")
    summary = run_bench(tiny, tmp_path)
    assert summary["mode"] == "natural lengths"
    for name in ("rlkit", "trl"):
        assert len(summary["runs"][name][0]["reward_curve"]) == 2
        t = summary["throughput"][name]
        assert t["mean_step_s"] > 0 and 0 < t["gen_tokens_per_step"] <= 2 * 2 * 6
    assert summary["ratio_step_time"] == pytest.approx(
        summary["throughput"]["rlkit"]["mean_step_s"] / summary["throughput"]["trl"]["mean_step_s"]
    )
    assert set(summary["learning"]) >= {"reward_level", "rlkit", "trl"}


def test_fixed_length_gives_both_frameworks_the_same_work(tiny, tmp_path):
    """Every response is exactly --max-new-tokens long in both, and both train every row (the tiny model's
    rewards are all 0, so rlkit would skip every row as zero-std without the fixed-length settings)."""
    pytest.importorskip("trl")
    summary = run_bench(tiny, tmp_path, "--fixed-length")
    assert summary["mode"] == "fixed-length" and summary["learning"] is None
    assert run_bench(tiny, tmp_path, "--fixed-length", "--report-only")["throughput"] == summary["throughput"]
    for name in ("rlkit", "trl"):
        t = summary["throughput"][name]
        assert t["gen_tokens_per_step"] == 2 * 2 * 6, name
        # Counted tokens: the 4 rows' prompts plus their 24 response tokens.
        assert t["learner_tokens_per_step"] > 24 and t["learner_tokens_per_s"] > 0, name
