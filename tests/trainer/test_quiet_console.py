"""A first run's console: the progress bar, the evaluations and real problems, each once. A short
`+recipe=quickstart` on vLLM's CPU build (a tiny random model in the quickstart's place, so dynamic sampling
falls short every step) prints no WARNING line but one: vLLM's start-up notices about choices rlkit made are
kept back (rlkit/rollout/engines/vllm/logs.py; tests/rollout/test_vllm_logs.py holds the bf16 engine's
per-tensor dtype notices), the push's routine lines too, and dynamic sampling's shortfall is a metric and one
line of information, not a warning a step. The one: vLLM's CPU worker binds memory to a NUMA node through
torch's C++ logger, which writes to stderr itself, out of reach of Python's logging."""

import re

import pytest
from run_helpers import launch, read_jsonl
from vllm_import import import_vllm

pytestmark = pytest.mark.slow  # a launched trainer run with vLLM: `make test-fast` leaves it out

import_vllm()

# A warning as a user sees one: a logging record at WARNING (Hydra's "[WARNING]", vLLM's "WARNING 11-26 ...",
# a worker's "WARNING ...") or a Python warning ("UserWarning: ...").
WARNING_LINE = re.compile(r"\[WARNING\]|^WARNING\b|\bWARNING \d\d-\d\d|\b\w*Warning: ")
NUMA = re.compile(r"^\[W\d+ [\d:.]+ utils\.cpp:\d+\] Warning: NUMA binding: ")  # vLLM's CPU worker, C++


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from rlkit.models import make_tiny_checkpoint

    # head_dim 32: the smallest vLLM's CPU attention runs
    return make_tiny_checkpoint(tmp_path_factory.mktemp("tiny"), hidden_size=128, num_layers=2, seed=0)


def test_a_short_quickstart_prints_no_warning(tiny, tmp_path, monkeypatch):
    # What an engine built earlier in the launching process leaves in the environment (in this suite, the
    # in-process engine tests; for a user, a notebook): vLLM's own VLLM_DIST_IDENT and V1 multiprocessing off.
    monkeypatch.setenv("VLLM_DIST_IDENT", "earlier-engine")
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    # fp32 (the recipe's auto on a CPU without native bf16). A fixed peak for MFU: measured at start-up beside
    # the rest of the suite, it would be disturbed, and rlkit rightly warns when a phase then runs above it.
    proc = launch(
        tmp_path, "+recipe=quickstart", f"model.path={tiny}", "model.dtype=float32", "model.compute_dtype=float32",
        "trainer.peak_tflops=100", "rollout.engine=vllm",
        "+rollout.engine_kwargs.kv_cache_gib=0.25", f"trainer.run_dir={tmp_path / 'run'}", "trainer.steps=2",
        "trainer.eval_every=1", "trainer.save_every=2", "trainer.train_batch_size=8", "rollout.group_size=4",
        "data.num_train=32", "data.num_eval=8", "data.eval_size=4", "reward.num_workers=1", "logger=none",
        "trainer.progress_bar=true",
    )  # fmt: skip
    console = (proc.stdout + proc.stderr).splitlines()
    warnings = [line for line in console if WARNING_LINE.search(line)]
    assert [line for line in warnings if not NUMA.search(line)] == [], "\n".join(warnings)
    assert len(warnings) <= 1  # the NUMA line, once (absent where vLLM binds no memory node)
    history = read_jsonl(tmp_path / "run" / "metrics.jsonl")
    # the tiny random model never answers right: dynamic sampling falls short at every step, said once
    assert all(m["dynamic/shortfall_groups"] > 0 for m in history if "dynamic/shortfall_groups" in m)
    assert sum("dynamic sampling:" in line for line in console) == 1
    assert any("dynamic sampling fell short on 2 of 2 steps" in line for line in console)
    assert any(re.search(r"train: 100%.*2/2", line) for line in console)  # the bar ran to its end
