"""Async training with weights updated in flight (trainer.inflight_updates=recompute, vLLM's CPU build):
the rollout worker takes a push between two engine steps of a batch, so rows mix policy versions. Checked:
at least one mixed row and one in-flight swap, every token's version between the batch's oldest and the
step that trains it, the oldest within trainer.max_staleness, and the logged staleness metrics agree with
the batches the learner received.

The swap is made certain, not left to timing: an environment (Gated) holds the episodes of the second batch
at their start until the learner has put its push on the queue and begun the weight broadcast; their
generation (12 tokens, no stop string) takes that push between two engine steps. Runs with in-flight swaps are not bit-reproducible
(where a swap lands depends on timing), so no exact-resume check here."""

import pytest
import torch
from test_e2e import train
from vllm_import import import_vllm

import_vllm()

from rlkit.batch import NO_VERSION  # noqa: E402


@pytest.fixture(scope="module")
def tiny128(tmp_path_factory):
    from rlkit.models import make_tiny_checkpoint

    # head_dim 32: the smallest vLLM's CPU attention runs
    return make_tiny_checkpoint(tmp_path_factory.mktemp("tiny128"), hidden_size=128, num_layers=2, seed=0)


def test_inflight_recompute_run_has_mixed_rows_within_the_staleness_bound(tiny128, tmp_path):
    from rlkit.rollout.remote import client
    from rlkit.rollout.remote.client import AsyncRollouts

    flags = tmp_path / "flags"
    flags.mkdir()
    batches, real_produce, real_send, sends = [], AsyncRollouts.produce, client.send_weights, []

    def spy_produce(self, step, timers):
        sb = real_produce(self, step, timers)
        batches.append((step, sb.policy_version, sb.rollout.token_versions.clone(), sb.rollout.response_mask))
        (flags / "armed").touch()  # the next batch's episodes wait for the next push
        return sb

    def spy_send(*args, **kwargs):
        sends.append(1)
        if len(sends) > 1:  # the push of version 1 (its Push message is on the worker's queue)
            (flags / "pushed").touch()
        return real_send(*args, **kwargs)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(AsyncRollouts, "produce", spy_produce)
        mp.setattr(client, "send_weights", spy_send)
        hist = train(
            tiny128, tmp_path / "run", "trainer.mode=async", "trainer.max_staleness=1", "trainer.steps=2",
            "trainer.inflight_updates=recompute", "rollout.engine=vllm", "+rollout.engine_kwargs.kv_cache_gib=0.1",
            "env.name=rlkit_test_envs:Gated", f"+env.kwargs.flags={flags}", "env.max_turns=1",
            "env.max_total_tokens=32", "env.timeout_s=600", "trainer.lr=0.05", "trainer.eval_at_start=false", "data.eval_size=0",
        )  # fmt: skip
    assert len(hist) == len(batches) == 2
    mixed_rows = 0
    for (step, oldest, versions, mask), metrics in zip(batches, hist):
        model = versions != NO_VERSION
        assert torch.equal(model, mask.bool())  # every model token labelled, nothing else
        assert oldest == int(versions[model].min()) and step - oldest <= 1
        assert int(versions[model].max()) <= step
        for row, keep in zip(versions, model):
            row = row[keep]
            assert torch.all(row[1:] >= row[:-1])  # a row's versions only move forward
            mixed_rows += int(row.max() != row.min())
        lag = (step - versions[model]).double()
        assert metrics["staleness/token_max"] == float(lag.max()) <= 1
        assert metrics["staleness/token_mean"] == pytest.approx(float(lag.mean()))
        assert metrics["staleness/max"] == step - oldest
    assert mixed_rows >= 1
    assert sum(m["inflight/swaps"] for m in hist) >= 1
    assert max(m["inflight/mixed_rows"] for m in hist) > 0
