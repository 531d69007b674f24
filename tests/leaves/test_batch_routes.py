"""`routed_experts` (routing replay, issue 59): the engine's per-token expert choices, [N, P + T, L, k], laid out
like cat([prompt_ids, response_ids], 1); placed by rows_to_batch, re-padded by concat_rollouts, carried by
take_groups, select / padding_like / to and the async messages; a wrong shape is refused."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from rlkit.batch import RolloutBatch, ScoredBatch, TrainBatch
from rlkit.rollout.engines.base import rows_to_batch
from rlkit.rollout.remote.messages import BatchShare, Pending, dumps, load_pending, loads, save_pending
from rlkit.rollout.scored import concat_rollouts, take_groups

L, K = 2, 2


def _routes(tokens: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 8, (tokens, L, K), generator=g).to(torch.int16)


def _batch(prompts, responses, seed=0) -> tuple[RolloutBatch, list[torch.Tensor]]:
    rows = [(r, [-0.5] * len(r), "stop") for r in responses]
    routes = [_routes(len(p) + len(r), seed + i) for i, (p, r) in enumerate(zip(prompts, responses))]
    rb = rows_to_batch(prompts, rows, ["x"] * len(rows), n=1, pad_id=0, routes=routes)
    return rb, routes


def _expected(prompts, responses, routes, P, T) -> torch.Tensor:
    """Naive placement: row i's route for token j of cat(prompt, response) at column P - len(prompt) + j."""
    out = torch.full((len(prompts), P + T, L, K), -1, dtype=torch.int16)
    for i, (p, r) in enumerate(zip(prompts, responses)):
        for j in range(len(p) + len(r)):
            out[i, P - len(p) + j] = routes[i][j]
    return out


def test_rows_to_batch_aligns_routes_with_tokens():
    prompts, responses = [[5, 6, 7], [8]], [[1, 2], [3, 4, 9, 9]]
    rb, routes = _batch(prompts, responses)
    assert rb.routed_experts.shape == (2, 3 + 4, L, K)
    assert torch.equal(rb.routed_experts, _expected(prompts, responses, routes, 3, 4))


def test_concat_and_take_groups_repad_routes():
    a, ra = _batch([[5, 6, 7]], [[1]], seed=0)
    b, rbr = _batch([[8]], [[3, 4, 9]], seed=10)
    both = concat_rollouts([a, b])
    want = _expected([[5, 6, 7], [8]], [[1], [3, 4, 9]], ra + rbr, 3, 3)
    assert torch.equal(both.routed_experts, want)
    assert torch.equal(take_groups(both, [1]).routed_experts, want[1:])


def test_row_ops_and_messages_carry_routes(tmp_path):
    rb, _ = _batch([[5, 6, 7], [8]], [[1, 2], [3]])
    tb = TrainBatch(
        prompt_ids=rb.prompt_ids, prompt_mask=rb.prompt_mask, response_ids=rb.response_ids,
        response_mask=rb.response_mask, advantages=torch.zeros(rb.response_ids.shape),
        routed_experts=rb.routed_experts,
    )  # fmt: skip
    assert torch.equal(tb.select([1]).routed_experts, rb.routed_experts[1:])
    assert torch.equal(tb.padding_like(2).routed_experts, rb.routed_experts[[0, 0]])
    assert torch.equal(tb.to("cpu").routed_experts, rb.routed_experts)
    z = torch.zeros(2)
    sb = ScoredBatch(rb, z, z, {}, errors=0, timeouts=0, stats={}, policy_version=0)
    back = loads(dumps(BatchShare(worker=0, index=0, batch=sb, position=0, seconds={})), (BatchShare,))
    back = back.batch.rollout
    assert back.routed_experts.dtype == torch.int16
    assert torch.equal(back.routed_experts, rb.routed_experts)
    save_pending(tmp_path / "pending.safetensors", [Pending(0, sb, 0, {})])  # a checkpoint's pending batches
    (resumed,) = load_pending(tmp_path / "pending.safetensors")
    assert resumed.batch.rollout.routed_experts.dtype == torch.int16
    assert torch.equal(resumed.batch.rollout.routed_experts, rb.routed_experts)


def test_wrong_route_shape_refused():
    rb, _ = _batch([[5, 6, 7]], [[1, 2]])

    with pytest.raises(ValueError, match="routed_experts has shape"):
        dataclasses.replace(rb, routed_experts=rb.routed_experts[:, 1:])
