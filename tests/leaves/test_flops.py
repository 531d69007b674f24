"""The FLOP count (rlkit/flops.py) against a hand count on a tiny config."""

import datetime
import json
import logging
import math
import os
import subprocess
import sys
import time

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from rlkit import flops
from rlkit.flops import MEASURED, DevicePeak, ModelShape, cached_cpu_peak, measured_cpu_peak, sequence_flops


def _tiny(tie: bool):
    cfg = LlamaConfig(
        vocab_size=100, hidden_size=16, intermediate_size=40, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, tie_word_embeddings=tie,
    )  # fmt: skip
    return LlamaForCausalLM(cfg)


def test_model_shape_counts_every_matmul_weight_by_hand():
    # Per layer: q 16x16, k 16x8 and v 16x8 (2 kv heads of dim 4), o 16x16, gate/up 16x40 each, down 40x16.
    per_layer = 16 * 16 + 16 * 8 + 16 * 8 + 16 * 16 + 2 * 16 * 40 + 40 * 16
    head = 100 * 16  # the LM head is a matmul whether or not it shares the embedding's weight
    for tie in (True, False):
        shape = ModelShape.of(_tiny(tie))
        assert shape.matmul_params == 2 * per_layer + head
        assert shape.layers == 2 and shape.attention_width == 16


def test_sequence_flops_by_hand():
    shape = ModelShape(matmul_params=1000, layers=3, attention_width=8)
    # forward: T (2 N + 4 L d T); training: T (6 N + 12 L d T)
    assert sequence_flops(shape, 10, training=False) == 10 * (2 * 1000 + 4 * 3 * 8 * 10)
    assert sequence_flops(shape, 10, training=True) == 10 * (6 * 1000 + 12 * 3 * 8 * 10)
    assert sequence_flops(shape, 10, training=True) == 3 * sequence_flops(shape, 10, training=False)


def test_measured_peak_is_a_plausible_rate():
    peak = measured_cpu_peak(torch.float32, seconds=0.05, size=256)
    assert 1e8 < peak < 1e14


def _matmul_rate(size: int, seconds: float) -> float:
    """FLOP/s of a stream of `size` x `size` matmuls timed as a whole (how a training phase is timed)."""
    a, b = torch.randn(size, size), torch.randn(size, size)
    torch.mm(a, b)
    n, start = 0, time.perf_counter()
    while time.perf_counter() - start < seconds:
        torch.mm(a, b)
        n += 1
    return n * 2.0 * size**3 / (time.perf_counter() - start)


def test_peak_measured_under_a_busy_cpu_never_gives_mfu_above_1(tmp_path, caplog):
    # Every core busy with a spinner while the peak is measured (as a loaded machine at start-up) ...
    spin = [sys.executable, "-c", "while True: pass"]
    spinners = [subprocess.Popen(spin) for _ in range(os.cpu_count() or 2)]
    try:
        time.sleep(0.2)
        flops, source = cached_cpu_peak(torch.float32, path=tmp_path / "peak.json", seconds=0.03, size=256)
    finally:
        for p in spinners:
            p.kill()
            p.wait()
    assert source.startswith(MEASURED)
    peak = DevicePeak(
        flops, source, lambda achieved: measured_cpu_peak(torch.float32, seconds=0.03, size=256, runs=3)
    )
    # ... then the "phase" runs on the freed cores: whatever the measurement said, MFU stays <= 1.
    with caplog.at_level(logging.WARNING, logger="rlkit.flops"):
        for _ in range(3):
            achieved = _matmul_rate(256, 0.2)
            mfu = achieved / peak.covering(achieved)
            assert 0 < mfu <= 1.0
    raised = peak.flops > flops
    assert raised == any("peak measurement was disturbed" in r.getMessage() for r in caplog.records)


def test_covering_raises_a_low_peak_to_the_achieved_rate_and_keeps_a_high_one(caplog):
    peak = DevicePeak(
        100.0, "trainer.peak_tflops"
    )  # nothing to measure again: the achieved rate is the floor
    assert peak.covering(50.0) == 100.0 and not caplog.records
    with caplog.at_level(logging.WARNING, logger="rlkit.flops"):
        assert peak.covering(250.0) == 250.0
    assert "set trainer.peak_tflops" in caplog.text
    assert (
        DevicePeak(100.0, "m", lambda achieved: 400.0).covering(250.0) == 400.0
    )  # a fresh figure above the rate
    assert math.isnan(DevicePeak(float("nan"), "unknown GPU").covering(1e12))


def test_cached_peak_keeps_the_best_figure_with_its_date(tmp_path, monkeypatch):
    monkeypatch.setattr(flops, "machine_busy", lambda: False)
    path = tmp_path / "peak.json"
    fresh, source = cached_cpu_peak(torch.float32, path=path, seconds=0.02, size=128, runs=1)
    table = json.loads(path.read_text())
    (entry,) = table.values()
    assert entry["flops"] == fresh and "now" in source
    # A figure stored earlier above anything this CPU reaches now (an idle day) wins, with its date.
    entry.update(flops=1e18, date="2026-01-02")
    path.write_text(json.dumps(table))
    stored, source = cached_cpu_peak(torch.float32, path=path, seconds=0.02, size=128, runs=1)
    assert stored == 1e18 and "2026-01-02" in source and source.startswith(MEASURED)
    # A lower fresh figure leaves the stored one as it was, only marked as checked today.
    assert json.loads(path.read_text()) == {
        k: {**v, "checked": datetime.date.today().isoformat()} for k, v in table.items()
    }


def test_cached_peak_is_measured_once_a_day(tmp_path, monkeypatch):
    """The first run of the day measures (~0.8 s of its start); later runs that day take the stored figure."""
    monkeypatch.setattr(flops, "machine_busy", lambda: False)
    path = tmp_path / "peak.json"
    first, source = cached_cpu_peak(torch.float32, path=path, seconds=0.02, size=128, runs=1)
    assert "now" in source

    def must_not_measure(*args, **kwargs):
        raise AssertionError("measured again on the day it was checked")

    monkeypatch.setattr(flops, "measured_cpu_peak", must_not_measure)
    again, source = cached_cpu_peak(torch.float32, path=path, seconds=0.02, size=128, runs=1)
    assert again == first and source.startswith(MEASURED) and str(path) in source
    # An entry checked on an earlier day is measured again.
    table = json.loads(path.read_text())
    (entry,) = table.values()
    entry["checked"] = "2026-01-02"
    path.write_text(json.dumps(table))
    with pytest.raises(AssertionError, match="measured again"):
        cached_cpu_peak(torch.float32, path=path, seconds=0.02, size=128, runs=1)


def test_a_peak_measured_on_a_busy_machine_is_not_the_days_check(tmp_path, monkeypatch):
    """Before: the first measurement of the day, taken while the machine was busy, was the figure of every
    later run that day (each logging a too-high MFU and the "disturbed" warning)."""
    path = tmp_path / "peak.json"
    monkeypatch.setattr(os, "getloadavg", lambda: (3.0 * (os.cpu_count() or 1),) * 3)  # 3 runnable per core
    assert flops.machine_busy()
    cached_cpu_peak(torch.float32, path=path, seconds=0.02, size=128, runs=1)
    (entry,) = json.loads(path.read_text()).values()
    assert "checked" not in entry  # stored (the best so far), but not the day's check
    calls = []
    real = flops.measured_cpu_peak
    monkeypatch.setattr(flops, "measured_cpu_peak", lambda *a, **k: calls.append(1) or real(*a, **k))
    monkeypatch.setattr(os, "getloadavg", lambda: (0.0, 0.0, 0.0))  # the next start, on a quiet machine
    cached_cpu_peak(torch.float32, path=path, seconds=0.02, size=128, runs=1)
    assert calls == [1]  # measured again
    (entry,) = json.loads(path.read_text()).values()
    assert entry["checked"] == datetime.date.today().isoformat()


def test_a_peak_raised_at_run_time_is_measured_again_and_stored_for_the_next_runs(
    tmp_path, monkeypatch, caplog
):
    """Before: the run-time "measured again" read the same cached figure back, and the raised peak was not
    stored, so every later run that day logged a too-high MFU and the warning again."""
    monkeypatch.setattr(flops, "machine_busy", lambda: False)
    path = tmp_path / "peak.json"
    cached_cpu_peak(torch.float32, path=path, seconds=0.02, size=128, runs=1)
    table = json.loads(path.read_text())
    (entry,) = table.values()
    entry["flops"] = 1e3  # a figure from a busy moment, checked today
    path.write_text(json.dumps(table))
    low, source = cached_cpu_peak(torch.float32, path=path)
    assert low == 1e3
    calls = []

    def remeasure(achieved):  # what the trainer's _remeasure_peak does on rank 0
        calls.append(achieved)
        return cached_cpu_peak(
            torch.float32, path=path, fresh=True, at_least=achieved, seconds=0.02, size=128
        )[0]

    peak = DevicePeak(low, source, remeasure)
    achieved = 1e18  # above any CPU's matmul rate: the stored figure must become exactly this
    with caplog.at_level(logging.WARNING, logger="rlkit.flops"):
        assert peak.covering(achieved) == achieved
    assert calls == [achieved] and "measured again" in caplog.text
    # the next run of the day starts from the raised figure: no warning, MFU <= 1
    again, _ = cached_cpu_peak(torch.float32, path=path)
    assert again == achieved
