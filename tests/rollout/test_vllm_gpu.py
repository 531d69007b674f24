"""vLLM's sleep mode, which only CUDA has (`gpu` marker: skipped without a CUDA device). vLLM's CuMem allocator,
which sleep mode uses, takes one engine per process ("CuMem allocator can only be used for one instance per
process"): each sleep level runs in a process of its own (scripts/gpu_check_vllm.py --measure sleep), which also
shows whether close() with sleep mode ends the process cleanly (its exit code). The CPU test below holds that
no engine is built in the test's own process."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from vllm_import import import_vllm

ROOT = Path(__file__).resolve().parents[2]


def sleep_cycle(level: int) -> subprocess.CompletedProcess:
    """Build a colocated engine with sleep mode at `level`, generate, sleep, push, wake, generate, close: in a
    process of its own (one JSON line on stdout, printed before close())."""
    cmd = [
        sys.executable,
        str(ROOT / "scripts" / "gpu_check_vllm.py"),
        "--measure",
        "sleep",
        "--level",
        str(level),
    ]
    return subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=900)


@pytest.mark.gpu
@pytest.mark.parametrize("level", [1, 2])
def test_sleep_then_push_then_wake_generates_as_before(level):
    """Level 1 offloads the weights and drops the KV cache, level 2 drops both; after the push that follows
    every update, the engine generates what it generated before sleeping (same seed, same weights), and the
    process ends cleanly after close() (vLLM's CuMem teardown: issue 61 item 4)."""
    import_vllm()
    done = sleep_cycle(level)
    assert done.returncode == 0, (
        f"exit code {done.returncode} (close() with sleep mode?): {done.stderr[-3000:]}"
    )
    out = json.loads(done.stdout.strip().splitlines()[-1])
    assert out["level"] == level and out["sleep_enabled"], out
    assert out["freed_gib"] > 0, out  # the KV cache (and at level 2 the weights) left the GPU
    assert out["same_tokens"] and out["max_logprob_diff"] <= 1e-5, out


def test_each_sleep_level_runs_in_a_process_of_its_own(monkeypatch):
    """Issue 61 item 6: the GPU test builds no engine in pytest's process (two sleep-mode engines in one process
    trip vLLM's one-CuMem-instance assertion); each level is one subprocess."""
    import_vllm()
    from rlkit.rollout.engines.vllm import engine as vllm_engine

    def no_engine_here(*args, **kwargs):
        raise AssertionError("a vLLM engine built in the test's own process")

    commands = []

    def run(cmd, **kwargs):
        commands.append(cmd)
        level = int(cmd[cmd.index("--level") + 1])
        line = json.dumps({"level": level, "sleep_enabled": True, "freed_gib": 1.0, "same_tokens": True,
                           "max_logprob_diff": 0.0})  # fmt: skip
        return subprocess.CompletedProcess(cmd, 0, stdout=line + "\n", stderr="")

    monkeypatch.setattr(vllm_engine.VLLMEngine, "__init__", no_engine_here)
    monkeypatch.setattr(subprocess, "run", run)
    for level in (1, 2):
        test_sleep_then_push_then_wake_generates_as_before(level)
    assert [c[-4:] for c in commands] == [
        ["--measure", "sleep", "--level", "1"],
        ["--measure", "sleep", "--level", "2"],
    ]
    assert all(c[1].endswith("scripts/gpu_check_vllm.py") for c in commands)
