"""A verified async push names a dead rollout worker before any blocking copy (issue 61 item 10). Under NCCL the
broadcasts are only queued; the digest of the next tensor copies it to the host, which waits behind them, and
with a dead receiver they never finish: rank 0 must poll the workers' liveness (`alive`) before that copy, not
only after the last broadcast (it would otherwise hang, unnamed, until NCCL's timeout)."""

from __future__ import annotations

import pytest
import torch

from rlkit import weights


class Queued:
    """An NCCL broadcast's work whose receiver died: queued on the stream, never completed."""

    def is_completed(self) -> bool:
        return False


def test_a_dead_worker_is_named_before_the_digest_copies_behind_an_unfinished_broadcast(monkeypatch):
    events = []

    def broadcast(pg, tensor, device, src=0):
        events.append("broadcast")
        return tensor, Queued()

    def digest(tensor):
        # What the device-to-host copy does behind an unfinished broadcast: it never returns.
        if "broadcast" in events:
            raise AssertionError("a blocking copy behind an unfinished broadcast, before the liveness poll")
        events.append("digest")
        return "d"

    def alive():
        events.append("alive")
        raise RuntimeError("rollout worker 1 exited with code -9 without reporting an error")

    monkeypatch.setattr(weights, "broadcast", broadcast)
    monkeypatch.setattr(weights, "digest", digest)
    tensors = [("a", torch.zeros(2)), ("b", torch.ones(2)), ("c", torch.ones(3))]
    export = weights.Export({n: tuple(t.shape) for n, t in tensors}, lambda: iter(tensors))
    with pytest.raises(RuntimeError, match="rollout worker 1 exited"):
        weights.send_weights(
            object(), export, torch.float32, is_main=True, device="cpu", digests={}, timeout_s=60, alive=alive
        )
    assert events == ["digest", "broadcast", "alive"]


def test_the_poll_before_a_digest_is_fine_grained_next_to_a_broadcast():
    """A tensor's broadcast takes milliseconds: the poll before each digest must not add a coarse interval to
    every tensor of a verified push (wait_on_host's default 0.2 s x ~300 tensors of a 0.5B model = a minute)."""
    assert weights.DIGEST_POLL_S <= 0.01
