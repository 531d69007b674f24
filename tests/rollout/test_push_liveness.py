"""A verified async push names a dead rollout worker before any blocking copy. Under NCCL the broadcasts are only
queued, and a copy to the host waits behind them: with a dead receiver they never finish, so rank 0 must poll the
workers' liveness (`alive`) before any such copy, or it hangs, unnamed, until NCCL's timeout. `send_weights`
digests each tensor on its device while streaming (no copy) and copies the digests to the host once, after
waiting on the last broadcast with the liveness poll."""

from __future__ import annotations

import pytest
import torch

from rlkit import weights


class Queued:
    """An NCCL broadcast's work whose receiver died: queued on the stream, never completed."""

    def is_completed(self) -> bool:
        return False


def test_a_dead_worker_is_named_before_the_digests_are_copied_behind_an_unfinished_broadcast(monkeypatch):
    events = []

    def broadcast(pg, tensor, device, src=0):
        events.append("broadcast")
        return tensor, Queued()

    def to_host(digests):
        # What the device-to-host copy does behind an unfinished broadcast: it never returns.
        raise AssertionError(
            f"a blocking copy behind an unfinished broadcast, before the liveness poll: {events}"
        )

    def alive():
        events.append("alive")
        raise RuntimeError("rollout worker 1 exited with code -9 without reporting an error")

    monkeypatch.setattr(weights, "broadcast", broadcast)
    monkeypatch.setattr(weights, "to_host", to_host)
    tensors = [("a", torch.zeros(2)), ("b", torch.ones(2)), ("c", torch.ones(3))]
    export = weights.Export({n: tuple(t.shape) for n, t in tensors}, lambda: iter(tensors))
    with pytest.raises(RuntimeError, match="rollout worker 1 exited"):
        weights.send_weights(
            object(), export, torch.float32, is_main=True, device="cpu", digests={}, timeout_s=60, alive=alive
        )
    assert events == ["broadcast", "broadcast", "broadcast", "alive"]
