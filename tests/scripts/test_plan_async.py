"""scripts/plan_async.py: the step-time model against values worked out by hand, and its reading of a run."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
spec = importlib.util.spec_from_file_location("plan_async", REPO / "scripts" / "plan_async.py")
plan = importlib.util.module_from_spec(spec)
spec.loader.exec_module(plan)


def test_linear_scaling_never_beats_sync():
    # g=4, l=2, p=1 on N=2: sync 4+2+1 = 7; async: generation on 1 of 2 devices takes 8, learning 4 -> 8+1.
    p = plan.predict(4.0, 2.0, 1.0, gpus=2, rollout_gpus=1)
    assert (p["sync_s"], p["gen_s"], p["learn_s"], p["async_s"]) == (7.0, 8.0, 4.0, 9.0)
    # N=6, R=4 balances 4*6/4 = 6 against 2*6/2 = 6: async = 6+1 = 7 = sync, the best linear scaling allows.
    assert plan.predict(4.0, 2.0, 1.0, gpus=6, rollout_gpus=4)["async_s"] == 7.0


def test_sublinear_generation_lets_async_win():
    # a_gen = 0.5: generation on 2 of 8 devices takes 4 * (8/2)**0.5 = 8; learning on 6 takes 6 * 8/6 = 8.
    p = plan.predict(4.0, 6.0, 0.5, gpus=8, rollout_gpus=2, a_gen=0.5)
    assert p["gen_s"] == pytest.approx(8.0) and p["learn_s"] == pytest.approx(8.0)
    assert p["sync_s"] == 10.5 and p["async_s"] == pytest.approx(8.5)
    assert p["speedup"] == pytest.approx(10.5 / 8.5)


def test_bad_split_is_refused():
    with pytest.raises(ValueError, match="rollout_gpus=2 must be between 1 and gpus - 1 = 1"):
        plan.predict(1.0, 1.0, 0.0, gpus=2, rollout_gpus=2)


def test_phases_from_a_run_and_the_command_line(tmp_path):
    lines = [
        {"step": 0, "eval/pass@1": 0.1},  # the baseline eval: no timing
        {"step": 1, "timing/step_s": 99.0, "timing/generate_s": 90.0},  # warm-up, skipped
        {"step": 2, "timing/step_s": 7.0, "timing/generate_s": 3.0, "timing/reward_s": 1.0,
         "timing/logprobs_s": 0.5, "timing/update_s": 1.5, "timing/weight_push_s": 1.0},
        {"step": 3, "timing/step_s": 9.0, "timing/generate_s": 5.0, "timing/reward_s": 1.0,
         "timing/logprobs_s": 0.5, "timing/update_s": 1.5, "timing/weight_push_s": 1.0},
    ]  # fmt: skip
    (tmp_path / "metrics.jsonl").write_text("\n".join(json.dumps(x) for x in lines))
    ph = plan.phases_from_run(tmp_path)
    assert (ph["gen_s"], ph["learn_s"], ph["push_s"], ph["step_s"], ph["steps"]) == (5.0, 2.0, 1.0, 8.0, 2)
    out = subprocess.run(
        [sys.executable, str(REPO / "scripts" / "plan_async.py"), "--run", str(tmp_path), "--gpus", "2"],
        capture_output=True, text=True, check=True,
    ).stdout  # fmt: skip
    assert "| 1 | 1 | 8.00 | 11.00 | 0.73x |" in out  # sync 5+2+1; async max(10, 4) + 1


def test_long_tail_model_by_hand():
    # 3 responses of 10 tokens and one of 100 at 0.02 s per step: drained 100 * 0.02 = 2 s, slot use
    # mean 32.5 / 100, streaming 32.5 * 0.02 = 0.65 s. The push lands at 0.5 + 0.1 = 0.6 s = token 30: staleness
    # (10 + 10 + 10 + 30) / 130 of the tokens.
    lengths = plan.tail_lengths(4, 10, 100, 0.25)
    assert sorted(lengths) == [10, 10, 10, 100]
    t = plan.long_tail(lengths, 0.02, 0.5, 0.1)
    assert t["drained_s"] == pytest.approx(2.0) and t["streaming_s"] == pytest.approx(0.65)
    assert t["slot_use"] == pytest.approx(0.325)
    assert t["staleness_inflight"] == pytest.approx(60 / 130) and t["staleness_off"] == 1.0
    # Generation done before the push: every token stays one version old.
    assert plan.long_tail(lengths, 0.001, 0.5, 0.1)["staleness_inflight"] == 1.0
    out = subprocess.run(
        [sys.executable, str(REPO / "scripts" / "plan_async.py"), "--gpus", "2", "--lengths", "4:10:100:0.25",
         "--step-ms", "20"], capture_output=True, text=True, check=True,
    ).stdout  # fmt: skip
    assert "drained generation 2.00 s (slot use 32%)" in out and "1.00 without in-flight updates" in out
