"""`rlkit.sync.WeightSync` with a recording stand-in for the rollout side: versions, the eval that rides on a
push, the push's metrics, and the log-prob check of the first batches after (re)start."""

import pytest
import torch

from rlkit.config.schema import RLConfig
from rlkit.sync import WeightSync
from rlkit.weights import Export, WeightSyncError


class Recorder:
    engine_name = "recorder"
    last_eval: list = []

    def __init__(self):
        self.calls = []

    def start(self, export, step, *, evaluate=False):
        self.calls.append(("start", step, evaluate))

    def push(self, export, version, *, evaluate=False):
        self.calls.append(("push", version, evaluate))
        return {
            "bytes": 2e9,
            "verify_seconds": 0.5,
            "export_seconds": 0.25,
            "load_seconds": 1.0,
            "probe_gap": 3e-7,
        }


def _sync(steps=10, eval_every=4, threshold=None, dtype="float32"):
    cfg = RLConfig()
    cfg.trainer.steps, cfg.trainer.eval_every = steps, eval_every
    cfg.rollout.weight_sync_kl_threshold = threshold
    cfg.model.dtype = dtype
    rollouts = Recorder()
    return WeightSync(cfg, rollouts, compute_dtype=torch.float32), rollouts


EXPORT = Export({}, lambda: iter(()))


def test_versions_count_pushes_from_the_start_step_and_evals_ride_on_due_pushes():
    sync, rollouts = _sync(steps=10, eval_every=4)
    sync.start(EXPORT, 3, evaluate=True)
    for _ in range(7):
        sync.push(EXPORT)
    # versions 4..10; an eval is due at multiples of 4 and at the last step (10), by hand:
    assert rollouts.calls == [("start", 3, True)] + [("push", v, v in (4, 8, 10)) for v in range(4, 11)]
    assert sync.version == 10


def test_the_push_metrics_come_from_its_statistics():
    sync, _ = _sync()
    sync.start(EXPORT, 0)
    metrics = sync.push(EXPORT)
    assert metrics == {
        "perf/weight_push_gb": 2.0, "timing/verify_push_s": 0.5, "timing/push_export_s": 0.25,
        "timing/push_load_s": 1.0, "weight_sync/probe_gap": 3e-7,
    }  # fmt: skip


@pytest.mark.parametrize("dtype, bound", [("float32", 0.05), ("bfloat16", 0.15)])
def test_the_first_two_fresh_batches_after_start_are_checked_against_the_dtypes_bound(dtype, bound):
    sync, _ = _sync(dtype=dtype)
    sync.start(EXPORT, 5)
    over = {"staleness/max": 0.0, "mismatch/kl": bound * 1.01}
    under = {"staleness/max": 0.0, "mismatch/kl": -bound * 0.99}
    with pytest.raises(WeightSyncError, match="right after the first weight push"):
        sync.check_first_batches(over, 5)
    with pytest.raises(WeightSyncError, match="recorder"):
        sync.check_first_batches({**over, "mismatch/kl": -bound * 1.01}, 6)
    sync.check_first_batches(under, 5)
    sync.check_first_batches(over, 7)  # later batches: policy change, not a failed push
    sync.check_first_batches({**over, "staleness/max": 1.0}, 5)  # a stale batch (async)


def test_step_zero_is_named_and_a_configured_bound_wins():
    sync, _ = _sync(threshold=1e-3)
    sync.start(EXPORT, 0)
    with pytest.raises(WeightSyncError, match=r"before training \(step 0\)"):
        sync.check_first_batches({"staleness/max": 0.0, "mismatch/kl": 2e-3}, 0)
