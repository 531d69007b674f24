"""`rlkit.sync.WeightSync` with a recording stand-in for the rollout side: versions, the eval that rides on a
push, the push's metrics, the log-prob check of the first batches after (re)start, and the probe a push leaves
to the batch its version samples."""

import pytest
import torch

from rlkit.config.schema import RLConfig
from rlkit.sync import WeightSync
from rlkit.weights import Export, WeightSyncError


class Recorder:
    engine_name = "recorder"
    last_eval: list = []

    def start(self, export, step, *, evaluate=False):
        self.calls.append(("start", step, evaluate))

    def __init__(self):
        self.calls = []
        self.stats = {
            "bytes": 2e9,
            "verify_seconds": 0.5,
            "export_seconds": 0.25,
            "load_seconds": 1.0,
            "probe_gap": 3e-7,
        }

    def push(self, export, version, *, evaluate=False):
        self.calls.append(("push", version, evaluate))
        return dict(self.stats)


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
        sync.check_batch(over, 5)
    with pytest.raises(WeightSyncError, match="recorder"):
        sync.check_batch({**over, "mismatch/kl": -bound * 1.01}, 6)
    sync.check_batch(under, 5)
    sync.check_batch(over, 7)  # later batches: policy change, not a failed push
    sync.check_batch({**over, "staleness/max": 1.0}, 5)  # a stale batch (async)


def test_step_zero_is_named_and_a_configured_bound_wins():
    sync, _ = _sync(threshold=1e-3)
    sync.start(EXPORT, 0)
    with pytest.raises(WeightSyncError, match=r"before training \(step 0\)"):
        sync.check_batch({"staleness/max": 0.0, "mismatch/kl": 2e-3}, 0)


def _batch(gap, staleness=0.0):
    return {"staleness/max": staleness, "mismatch/kl": 0.0, "mismatch/logprob_abs_diff": gap}


def test_a_push_left_to_its_batch_is_checked_on_that_batch_only_against_its_bound():
    sync, rollouts = _sync(steps=10)
    rollouts.stats = {"bytes": 1e9, "probe_bound": 1e-4}
    sync.start(EXPORT, 0)
    sync.check_batch(_batch(0.5), 0)  # version 0 was probed at start (no bound left to its batch)
    metrics = sync.push(EXPORT)  # version 1: its probe is the batch of step 1
    assert "weight_sync/probe_gap" not in metrics and "probe_bound" not in metrics
    sync.check_batch(_batch(0.99e-4), 1)
    sync.push(EXPORT)  # version 2
    with pytest.raises(
        WeightSyncError,
        match=r"recorder engine's log-probs differ from the learner's after the push "
        r"of version 2: mean \|dlogp\| = 0.02 on the tokens it sampled for step 3, above 0.0001",
    ):
        sync.check_batch(_batch(0.02), 2)
    sync.push(EXPORT)  # version 3, trained one version stale (async): policy change, not the push's drift
    sync.check_batch(_batch(0.02, staleness=1.0), 3)
    sync.check_batch(_batch(0.02), 4)  # no push of version 4 left its probe to this batch
    assert sync.batch_probes == {}


def test_the_accepted_engine_gap_widens_the_batch_probe_as_it_does_the_fixed_one():
    sync, rollouts = _sync(steps=10)
    sync.cfg.rollout.accept_engine_gap = 0.01
    rollouts.stats = {"probe_bound": 1e-4}
    sync.start(EXPORT, 0)
    sync.push(EXPORT)
    sync.check_batch(_batch(0.009), 1)
    sync.push(EXPORT)
    with pytest.raises(WeightSyncError, match="rollout.accept_engine_gap"):
        sync.check_batch(_batch(0.011), 2)
