"""scripts/sft_then_rl.py's own parts: the clock it reads off a run's metrics.jsonl, the stop at the first
evaluation past the time budget, and the mean and standard error over seeds (worked by hand)."""

import math
import sys
import time

from rlkit.config.schema import REPO_ROOT

sys.path.insert(0, str(REPO_ROOT / "scripts"))
import sft_then_rl  # noqa: E402

# A fake run: an evaluation line, then a training line, every 0.4 s, five times; then exit 0.
WRITER = """
import json, sys, time
with open(sys.argv[1], "a") as f:
    for step in range(5):
        f.write(json.dumps({"step": step, "eval/pass@1": step / 10}) + "\\n")
        f.write(json.dumps({"step": step, "loss": 1.0}) + "\\n")
        f.flush()
        time.sleep(0.4)
"""


def test_every_evaluation_is_timestamped_and_the_run_ends(tmp_path):
    metrics = tmp_path / "metrics.jsonl"
    start = time.monotonic()
    evals = sft_then_rl.watch([sys.executable, "-c", WRITER, str(metrics)], metrics, tmp_path / "log")
    assert [e["step"] for e in evals] == [0, 1, 2, 3, 4]  # training lines are not evaluations
    assert [e["eval/pass@1"] for e in evals] == [0.0, 0.1, 0.2, 0.3, 0.4]
    seconds = [e["seconds"] for e in evals]
    assert seconds == sorted(seconds) and seconds[-1] <= time.monotonic() - start
    assert seconds[-1] - seconds[0] >= 4 * 0.4 - 0.5  # lines 0.4 s apart, polled every 0.5 s
    assert evals[-1]["cpu_seconds"] > 0


def test_a_budget_stops_the_run_at_its_first_evaluation_past_it(tmp_path):
    metrics = tmp_path / "metrics.jsonl"
    cmd = [sys.executable, "-c", WRITER.replace("range(5)", "range(100)"), str(metrics)]
    start = time.monotonic()
    evals = sft_then_rl.watch(cmd, metrics, tmp_path / "log", stop_after_s=1.5)
    assert time.monotonic() - start < 10  # 100 evaluations would take 40 s
    assert evals[-1]["seconds"] >= 1.5 and all(e["seconds"] < 1.5 for e in evals[:-1])


def test_mean_and_standard_error_over_seeds():
    # 0.5, 0.6, 0.7: mean 0.6, sample variance ((0.1)^2 + 0 + (0.1)^2) / 2 = 0.01, SE sqrt(0.01 / 3)
    m, se = sft_then_rl.mean_se([0.5, 0.6, 0.7])
    assert math.isclose(m, 0.6) and math.isclose(se, math.sqrt(0.01 / 3))
    m, se = sft_then_rl.mean_se([0.25])
    assert m == 0.25 and math.isnan(se)
