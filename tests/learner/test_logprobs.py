"""Chunked log-probs / entropy (rlkit.learner.logprobs) and padding-free packing in the learner.

References are independent: transformers' own top-k / top-p warpers and torch.log_softmax with
autograd over the full logits, per-sample forward passes, and the learner's padded, unchunked path.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from cfg_helpers import learner_cfg
from learner_helpers import learner_grads, make_batch
from transformers import LogitsProcessorList, TopKLogitsWarper, TopPLogitsWarper

from rlkit.learner import Learner
from rlkit.learner.batching import microbatches, model_inputs
from rlkit.learner.logprobs import chunked_logprobs, truncation_mask

TRUNCATIONS = [(0, 1.0), (5, 1.0), (0, 0.8), (7, 0.6)]


def warped_log_softmax(z: torch.Tensor, top_k: int, top_p: float, targets: torch.Tensor) -> torch.Tensor:
    """log-probs as the HF engine samples: transformers' warpers, target token re-admitted."""
    warpers = LogitsProcessorList()
    if top_k > 0:
        warpers.append(TopKLogitsWarper(top_k))
    if top_p < 1:
        warpers.append(TopPLogitsWarper(top_p))
    kept = (
        torch.isfinite(warpers(None, z.detach().clone())) if warpers else torch.ones_like(z, dtype=torch.bool)
    )
    kept[torch.arange(len(targets)), targets] = True
    return torch.log_softmax(z.masked_fill(~kept, float("-inf")), -1), kept


@pytest.mark.parametrize("top_k,top_p", TRUNCATIONS)
def test_truncation_mask_keeps_what_transformers_warpers_keep(top_k, top_p):
    z = torch.randn(40, 60, generator=torch.Generator().manual_seed(top_k))
    _, kept = warped_log_softmax(z, top_k, top_p, torch.zeros(0, dtype=torch.long))
    mask = truncation_mask(z, top_k, top_p)
    assert (mask is None) == (top_k == 0 and top_p == 1.0)
    if mask is not None:
        assert torch.equal(mask, kept)
        assert 1 <= mask.sum(-1).min() and mask.sum(-1).max() < 60


def head_inputs(seed: int, m: int, h: int, v: int, weight_scale: float = 0.5):
    """Random leaves for the chunked head: hidden [m, h] and weight [v, h] (both requiring grad), targets [m],
    and two [m] loss weights a, b."""
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(m, h, generator=g, requires_grad=True)
    weight = (torch.randn(v, h, generator=g) * weight_scale).requires_grad_()
    targets = torch.randint(0, v, (m,), generator=g)
    return hidden, weight, targets, torch.randn(m, generator=g), torch.randn(m, generator=g)


@pytest.mark.parametrize("top_k,top_p", TRUNCATIONS)
def test_chunked_logprobs_entropy_and_gradients_equal_full_log_softmax(top_k, top_p):
    m, h, v, temp = 37, 16, 300, 0.7
    hidden, weight, targets, a, b = head_inputs(1, m, h, v)

    logp, ent = chunked_logprobs(
        hidden, weight, targets, temperature=temp, chunk_tokens=5, top_k=top_k, top_p=top_p, entropy_grad=True
    )
    (logp * a + ent * b).sum().backward()
    got = (logp.detach(), ent.detach(), hidden.grad.clone(), weight.grad.clone())
    hidden.grad = weight.grad = None

    ls, kept = warped_log_softmax((hidden @ weight.t()) / temp, top_k, top_p, targets)
    ref_logp = ls.gather(-1, targets[:, None]).squeeze(-1)
    ref_ent = -(ls.exp() * torch.where(kept, ls, 0.0)).sum(-1)
    (ref_logp * a + ref_ent * b).sum().backward()
    want = (ref_logp.detach(), ref_ent.detach(), hidden.grad, weight.grad)
    # float32 both ways: values to 1e-6; gradients (sums over the vocabulary) to 1e-4 relative.
    for x, y, rtol in zip(got, want, [1e-6, 1e-6, 1e-4, 1e-4]):
        torch.testing.assert_close(x, y, rtol=rtol, atol=1e-6)
    assert torch.isfinite(logp).all()  # the target is always in the kept set


def test_entropy_is_a_constant_unless_asked_for():
    hidden = torch.randn(6, 4, requires_grad=True)
    weight = torch.randn(10, 4, requires_grad=True)
    logp, ent = chunked_logprobs(hidden, weight, torch.arange(6), chunk_tokens=4)
    assert logp.requires_grad and not ent.requires_grad


# -- the learner: packed / padded x chunked / unchunked ------------------------------------------------


def cfg(path, **kw):
    base = dict(model_path=path, dtype="float32", lr=1e-3, max_grad_norm=None, seed=0)
    return learner_cfg(**{**base, **kw})


LOSS = dict(kl_coef=0.1, rollout_kl_coef=0.05, entropy_coef=0.01, clip_high=0.28)
VARIANTS = {
    "padded-full": dict(pack_sequences=False, logprob_chunk_tokens=0),
    "padded-chunked": dict(pack_sequences=False, logprob_chunk_tokens=3),
    "packed-full": dict(pack_sequences=True, logprob_chunk_tokens=0),
    "packed-chunked": dict(pack_sequences=True, logprob_chunk_tokens=3),
}


@pytest.fixture(scope="module")
def variant_results(tiny_model_dir):
    batch = make_batch(n=7, seed=5)
    mask = batch.response_mask.clone()
    mask[3, 1] = False  # a hole in one loss mask
    batch = dataclasses.replace(batch, response_mask=mask)
    out = {}
    for name, kw in VARIANTS.items():
        for trunc in [dict(), dict(top_k=20, top_p=0.8, temperature=0.8)]:
            learner = Learner(cfg(tiny_model_dir, max_tokens_per_microbatch=40, **LOSS, **kw, **trunc))
            scored = learner.forward(batch)
            learner.accumulate_gradients(batch)
            counts = [len(mb.micros) for mb in learner.plan(batch, 1)]
            out[name, bool(trunc)] = (scored, learner_grads(learner), counts)
    return out


@pytest.mark.parametrize("name", ["padded-chunked", "packed-full", "packed-chunked"])
@pytest.mark.parametrize("truncated", [False, True])
def test_packed_and_chunked_equal_padded_full_logits(variant_results, name, truncated):
    ref_scored, ref_grads, _ = variant_results["padded-full", truncated]
    scored, grads, _ = variant_results[name, truncated]
    torch.testing.assert_close(scored.logprobs, ref_scored.logprobs, rtol=0, atol=1e-5)
    torch.testing.assert_close(scored.entropy, ref_scored.entropy, rtol=0, atol=1e-5)
    for k in ref_grads:
        torch.testing.assert_close(grads[k], ref_grads[k], rtol=1e-4, atol=1e-6, msg=k)


def test_truncation_changes_logprobs_and_never_gives_minus_inf(variant_results):
    full, trunc = variant_results["packed-chunked", False][0], variant_results["packed-chunked", True][0]
    assert torch.isfinite(trunc.logprobs).all()
    assert (full.logprobs - trunc.logprobs).abs().max() > 1e-2


def test_packed_budget_counts_real_tokens():
    batch = make_batch(n=6, prompt_width=10, response_width=10, prompt_lens=[2] * 6, response_lens=[3] * 6)
    real = [sum(p + r for p, r in m.lens) for m in microbatches(batch, 10, packed=True)]
    assert real == [10, 10, 10]  # 2 rows of 5 real tokens each, no padding counted
    assert len(microbatches(batch, 10, packed=False)) == 3  # padded width 5 too: same here
    # A long prompt and a long response: 10 + 10 real tokens, but padded 2 x (9 + 9).
    ragged = make_batch(n=2, prompt_width=10, response_width=10, prompt_lens=[9, 1], response_lens=[1, 9])
    assert len(microbatches(ragged, 20, packed=True)) == 1
    assert len(microbatches(ragged, 20, packed=False)) == 2


def test_packed_inputs_restart_positions_and_hold_only_real_tokens():
    plens, rlens = [2, 4, 1], [3, 1, 2]
    batch = make_batch(n=3, prompt_width=6, response_width=5, prompt_lens=plens, response_lens=rlens)
    (m,) = microbatches(batch, 100, packed=True)
    assert m.rows.tolist() == [0, 1, 2]
    inp = model_inputs(m, packed=True, device="cpu")
    ids = [
        batch.prompt_ids[i, -p:].tolist() + batch.response_ids[i, :r].tolist()
        for i, (p, r) in enumerate(zip(plens, rlens))
    ]
    assert inp.attention_mask is None
    assert inp.input_ids.tolist() == [sum(ids, [])]
    assert inp.position_ids.tolist() == [[0, 1, 2, 3, 4] + [0, 1, 2, 3, 4] + [0, 1, 2]]
    # Response token j of row i is predicted by the hidden state just before it.
    starts = [0, 5, 10]
    want = [starts[i] + plens[i] - 1 + j for i in range(3) for j in range(rlens[i])]
    assert inp.cols[inp.take].tolist() == want


def test_critic_values_packed_equal_padded(tiny_model_dir):
    batch = make_batch(n=5, seed=9, all_fields=False)
    values = {}
    for pack in (False, True):
        learner = Learner(
            cfg(tiny_model_dir, value_model=True, pack_sequences=pack, max_tokens_per_microbatch=30)
        )
        values[pack] = learner.forward(batch, policy=False, values=True).values
    assert values[True].abs().sum() > 0
    torch.testing.assert_close(values[True], values[False], rtol=0, atol=1e-5)


def test_chunked_head_multiplies_at_the_matmul_dtype_and_keeps_fp32_master_gradients():
    """bf16 compute with fp32 master weights: the head's matmuls in bf16 (as autocast would run the model's
    own head), softmax and the gradient sums in fp32, the weight's gradient returned in fp32.

    Reference: autograd through torch.log_softmax of the full logits computed by a bf16 matmul of the
    bf16-cast fp32 leaves (what autocast does), unchunked."""
    m, h, v, temp = 41, 64, 500, 0.9
    hidden, weight, targets, a, b = head_inputs(3, m, h, v)

    def chunked(mm):
        logp, ent = chunked_logprobs(
            hidden, weight, targets, temperature=temp, chunk_tokens=8, entropy_grad=True, matmul_dtype=mm
        )
        (logp * a + ent * b).sum().backward()
        out = (logp.detach(), ent.detach(), hidden.grad.clone(), weight.grad.clone())
        hidden.grad = weight.grad = None
        return out

    def full(mm):
        z = (hidden.to(mm) @ weight.to(mm).t()).float() / temp
        ls = torch.log_softmax(z, -1)
        lp, ent = ls.gather(-1, targets[:, None]).squeeze(-1), -(ls.exp() * ls).sum(-1)
        (lp * a + ent * b).sum().backward()
        out = (lp.detach(), ent.detach(), hidden.grad.clone(), weight.grad.clone())
        hidden.grad = weight.grad = None
        return out

    got, want, want32 = chunked(torch.bfloat16), full(torch.bfloat16), full(torch.float32)
    assert got[2].dtype == got[3].dtype == torch.float32  # master gradients stay fp32
    for x, y, name in zip(got, want, ["logp", "entropy", "grad hidden", "grad weight"]):
        # Same bf16 products; only the rounding of per-chunk partial sums differs (2^-8 relative).
        torch.testing.assert_close(x, y, rtol=2e-2, atol=2e-2 * y.abs().max().item(), msg=name)
    # The matmul really ran in bf16: the result is far nearer the bf16 reference than the fp32 one.
    near = (got[0] - want[0]).abs().mean()
    far = (got[0] - want32[0]).abs().mean()
    assert far > 1e-3 and near < far / 10, (near, far)
    # Default: the weight's dtype (fp32 here) -> equals the fp32 reference.
    for x, y in zip(chunked(None), want32):
        torch.testing.assert_close(x, y, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("uses", ["logp", "entropy", "both"])
@pytest.mark.parametrize("top_k,top_p", [(0, 1.0), (7, 0.6)])
def test_backward_when_the_loss_uses_one_output_or_both(uses, top_k, top_p):
    """The backward has three cases (log-prob only: the one-buffer path; entropy only: no log-prob gradient;
    both), each against autograd through the full log-softmax."""
    m, h, v = 23, 8, 90
    hidden, weight, targets, a, b = head_inputs(5, m, h, v, weight_scale=1.0)

    def loss(lp, ent):
        return {"logp": (lp * a).sum(), "entropy": (ent * b).sum(), "both": (lp * a + ent * b).sum()}[uses]

    lp, ent = chunked_logprobs(
        hidden, weight, targets, temperature=1.3, chunk_tokens=6, top_k=top_k, top_p=top_p, entropy_grad=True
    )
    loss(lp, ent).backward()
    got = (hidden.grad.clone(), weight.grad.clone())
    hidden.grad = weight.grad = None
    ls, kept = warped_log_softmax((hidden @ weight.t()) / 1.3, top_k, top_p, targets)
    loss(
        ls.gather(-1, targets[:, None]).squeeze(-1), -(ls.exp() * torch.where(kept, ls, 0.0)).sum(-1)
    ).backward()
    for x, y in zip(got, (hidden.grad, weight.grad)):
        torch.testing.assert_close(x, y, rtol=1e-4, atol=1e-6)


def test_no_entropy_asked_gives_none_and_the_same_logprobs():
    g = torch.Generator().manual_seed(6)
    hidden, weight = torch.randn(9, 8, generator=g), torch.randn(40, 8, generator=g)
    targets = torch.randint(0, 40, (9,), generator=g)
    with_ent = chunked_logprobs(hidden, weight, targets, chunk_tokens=4, top_k=5)
    without = chunked_logprobs(hidden, weight, targets, chunk_tokens=4, top_k=5, entropy=False)
    assert without[1] is None and with_ent[1].shape == (9,)
    assert torch.equal(with_ent[0], without[0])
