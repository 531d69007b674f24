"""The SFT step is the learner's update with `algo.policy_loss=nll` and token-mean: its loss and gradient equal
transformers' own labels loss (mean cross-entropy over the tokens not labelled -100) on the whole batch in one
piece, under micro-batches, packing and two gloo processes. The reference is transformers' loss, no rlkit code."""

from __future__ import annotations

import pytest
import torch
from cfg_helpers import learner_cfg
from learner_helpers import VOCAB, assert_grads_close, init_worker_env, learner_grads, load_fp32, spawn_ranks

from rlkit.algos.losses import aggregate, nll
from rlkit.data.sft import train_batch
from rlkit.learner import Learner

pytestmark = pytest.mark.slow  # a 2-process gloo launch and seconds of training

SFT = dict(policy_loss="nll", loss_agg_mode="token-mean", dtype="float32", max_grad_norm=None, lr=1e-3)
RANK_ROWS = ([0, 1, 2, 3, 4], [5, 6])  # uneven: the ranks hold different numbers of tokens


def rows(n: int = 7, seed: int = 0):
    """Ragged rows of random tokens, each with one or two 'assistant' spans in its mask."""
    g = torch.Generator().manual_seed(seed)
    ids, masks = [], []
    for i in range(n):
        length = int(torch.randint(6, 20, (1,), generator=g))
        ids.append(torch.randint(3, VOCAB, (length,), generator=g).tolist())
        start = int(torch.randint(1, length - 2, (1,), generator=g))
        mask = [start <= j < length - 1 for j in range(length)]
        if i % 3 == 0:
            mask[1] = True  # a second, earlier span
        masks.append(mask)
    return ids, masks


def hf_loss(model, ids, masks):
    """transformers' labels loss on the whole batch in one forward: -100 on padding and masked tokens."""
    width = max(len(t) for t in ids)
    input_ids = torch.zeros(len(ids), width, dtype=torch.long)
    attention = torch.zeros(len(ids), width, dtype=torch.long)
    labels = torch.full((len(ids), width), -100, dtype=torch.long)
    for i, (t, m) in enumerate(zip(ids, masks)):
        input_ids[i, : len(t)] = torch.tensor(t)
        attention[i, : len(t)] = 1
        labels[i, : len(t)] = torch.where(torch.tensor(m), torch.tensor(t), -100)
    return model(input_ids=input_ids, attention_mask=attention, labels=labels).loss


def hf_grads(model_dir, ids, masks):
    model = load_fp32(model_dir)
    loss = hf_loss(model, ids, masks)
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


def test_nll_is_the_token_mean_negative_log_likelihood():
    logp = torch.tensor([[-1.0, -2.0, float("nan")], [-0.5, -4.0, -3.0]])
    mask = torch.tensor([[True, True, False], [False, True, True]])
    per_token, _ = nll(logp, mask)
    assert per_token.tolist() == [[1.0, 2.0, 0.0], [0.0, 4.0, 3.0]]
    assert aggregate(per_token, mask, "token-mean").item() == pytest.approx((1 + 2 + 4 + 3) / 4)


@pytest.mark.parametrize("packed", [False, True], ids=["padded", "packed"])
@pytest.mark.parametrize("budget", [4096, 30], ids=["one-micro", "micro-batches"])
def test_sft_gradient_equals_transformers_full_batch(tiny_model_dir, packed, budget):
    ids, masks = rows()
    want_loss, want = hf_grads(tiny_model_dir, ids, masks)
    learner = Learner(
        learner_cfg(model_path=tiny_model_dir, max_tokens_per_microbatch=budget, pack_sequences=packed, **SFT)
    )
    batch = train_batch(ids, masks, pad_id=0)
    if budget == 30:
        assert len(learner.plan(batch, 1)[0].micros) >= 3  # the split happens
    metrics = learner.accumulate_gradients(batch)
    assert_grads_close(learner_grads(learner), want)
    torch.testing.assert_close(metrics["loss/policy"].float(), want_loss, atol=1e-5, rtol=1e-5)


def _worker(rank: int, world: int, port: int, model_dir: str, out: str) -> None:
    init_worker_env(rank, world, port)
    ids, masks = rows()
    learner = Learner(
        learner_cfg(model_path=model_dir, max_tokens_per_microbatch=30, pack_sequences=True, **SFT)
    )
    assert learner.world_size == 2
    local = [ids[i] for i in RANK_ROWS[rank]], [masks[i] for i in RANK_ROWS[rank]]
    metrics = learner.accumulate_gradients(train_batch(*local, pad_id=0))
    torch.save({"grads": learner_grads(learner), "loss": metrics["loss/policy"]}, f"{out}/rank{rank}.pt")
    torch.distributed.destroy_process_group()


def test_two_process_sft_gradient_equals_full_batch(tiny_model_dir, tmp_path):
    spawn_ranks(_worker, tiny_model_dir, str(tmp_path))
    ids, masks = rows()
    want_loss, want = hf_grads(tiny_model_dir, ids, masks)
    for rank in (0, 1):
        got = torch.load(tmp_path / f"rank{rank}.pt", weights_only=False)
        assert_grads_close(got["grads"], want)
        torch.testing.assert_close(got["loss"].float(), want_loss, atol=1e-5, rtol=1e-5)
