import math

import pytest
import torch
from algos_helpers import GARBAGE, fill_padding, ragged_mask

from rlkit.algos import losses


def _inputs(n=6, t=9, seed=0, dtype=torch.float64, spread=0.5):
    gen = torch.Generator().manual_seed(seed)
    mask = ragged_mask(n, t, gen)
    old = -torch.rand(n, t, generator=gen, dtype=dtype) * 3
    logp = old + spread * torch.randn(n, t, generator=gen, dtype=dtype)
    adv = torch.randn(n, t, generator=gen, dtype=dtype)
    return logp, old, adv, mask


# ---------------------------------------------------------------- PPO clip


def test_ppo_clip_by_hand():
    # ratios [1.5, 1.5, 0.5, 0.5] with A = [+1, -1, -1, +1], clip 0.2 ([0.8, 1.2]):
    #   A=+1, r=1.5: max(-1.5, -1.2) = -1.2, clipped high (grad 0)
    #   A=-1, r=1.5: max( 1.5,  1.2) =  1.5, unclipped (grad -A r = 1.5)
    #   A=-1, r=0.5: max( 0.5,  0.8) =  0.8, clipped low (grad 0)
    #   A=+1, r=0.5: max(-0.5, -0.8) = -0.5, unclipped (grad -0.5)
    old = torch.zeros(1, 4)
    logp = torch.log(torch.tensor([[1.5, 1.5, 0.5, 0.5]])).requires_grad_()
    adv = torch.tensor([[1.0, -1.0, -1.0, 1.0]])
    loss, m = losses.ppo_clip(logp, old, adv, torch.ones(1, 4))
    torch.testing.assert_close(loss, torch.tensor([[-1.2, 1.5, 0.8, -0.5]]))
    (grad,) = torch.autograd.grad(loss.sum(), logp)
    torch.testing.assert_close(grad, torch.tensor([[0.0, 1.5, 0.0, -0.5]]))
    assert m["clip_frac"] == 0.5 and m["clip_frac_high"] == 0.25 and m["clip_frac_low"] == 0.25
    assert m["dual_clip_frac"] == 0
    torch.testing.assert_close(m["ratio_mean"], torch.tensor(1.0))
    torch.testing.assert_close(m["ratio_max"], torch.tensor(1.5))
    torch.testing.assert_close(m["ratio_min"], torch.tensor(0.5))
    # approx_kl (k1) = mean(old - logp) = -(2 log 1.5 + 2 log 0.5) / 4.
    torch.testing.assert_close(m["approx_kl"], torch.tensor(-(math.log(1.5) + math.log(0.5)) / 2))
    # approx_kl_k3 = mean(r - 1 - log r).
    k3 = (0.5 - math.log(1.5) + -0.5 - math.log(0.5)) / 2
    torch.testing.assert_close(m["approx_kl_k3"], torch.tensor(k3))


def test_clip_higher_and_dual_clip_by_hand():
    # clip-higher: r=1.25, A=+1 is clipped at 1+0.2 but not at 1+0.28.
    logp, old, adv, mask = (
        torch.log(torch.tensor([[1.25]])),
        torch.zeros(1, 1),
        torch.ones(1, 1),
        torch.ones(1, 1),
    )
    torch.testing.assert_close(losses.ppo_clip(logp, old, adv, mask)[0], torch.tensor([[-1.2]]))
    torch.testing.assert_close(
        losses.ppo_clip(logp, old, adv, mask, clip_high=0.28)[0], torch.tensor([[-1.25]])
    )
    # dual clip c=3: A=-1, r=5: PPO gives max(5, 1.2) = 5, capped at -A*c = 3 (grad 0); r=2 stays 2.
    logp = torch.log(torch.tensor([[5.0, 2.0]])).requires_grad_()
    loss, m = losses.ppo_clip(logp, torch.zeros(1, 2), -torch.ones(1, 2), torch.ones(1, 2), dual_clip=3.0)
    torch.testing.assert_close(loss, torch.tensor([[3.0, 2.0]]))
    (grad,) = torch.autograd.grad(loss.sum(), logp)
    torch.testing.assert_close(grad, torch.tensor([[0.0, 2.0]]))
    assert m["dual_clip_frac"] == 0.5 and m["clip_frac"] == 0.5


@pytest.mark.parametrize("dual_clip", [None, 3.0])
def test_ppo_clip_equals_loop_and_gradient_rule(dual_clip):
    logp, old, adv, mask = _inputs(spread=0.6)
    logp.requires_grad_()
    loss, metrics = losses.ppo_clip(logp, old, adv, mask, clip_low=0.2, clip_high=0.28, dual_clip=dual_clip)
    (grad,) = torch.autograd.grad(loss.sum(), logp)
    exp_loss = torch.zeros_like(old)
    exp_grad = torch.zeros_like(old)
    clipped = valid = 0
    for i in range(old.shape[0]):
        for j in range(old.shape[1]):
            if not mask[i, j]:
                continue
            a = adv[i, j].item()
            r = math.exp(logp[i, j].item() - old[i, j].item())
            value, g = -a * r, -a * r
            if -a * min(max(r, 0.8), 1.28) > -a * r:
                value, g = -a * min(max(r, 0.8), 1.28), 0.0
            if dual_clip is not None and a < 0 and value > -a * dual_clip:
                value, g = -a * dual_clip, 0.0
            exp_loss[i, j], exp_grad[i, j] = value, g
            valid += 1
            clipped += g == 0.0
    torch.testing.assert_close(loss, exp_loss)
    torch.testing.assert_close(grad, exp_grad)
    torch.testing.assert_close(metrics["clip_frac"], torch.tensor(clipped / valid, dtype=torch.float64))
    assert 0 < clipped < valid  # both regions are exercised


def test_ppo_clip_gradcheck_unclipped_region():
    logp, old, adv, mask = _inputs(spread=0.05)  # |log r| < ~0.15, well inside [0.8, 1.2] for most tokens
    inside = (torch.exp(logp - old) - 1).abs() < 0.19
    mask = mask & inside
    logp.requires_grad_()
    assert torch.autograd.gradcheck(
        lambda lp: losses.aggregate(losses.ppo_clip(lp, old, adv, mask)[0], mask, "token-mean"), (logp,)
    )


# ---------------------------------------------------------------- GSPO


def test_gspo_by_hand():
    # Row log-ratios [log 2, 0] -> mean log 2 / 2 -> s = sqrt(2) for both tokens.
    logp = torch.tensor([[math.log(2.0), 0.0]], requires_grad=True)
    old, adv, mask = torch.zeros(1, 2), torch.ones(1, 2), torch.ones(1, 2)
    loss, m = losses.gspo(logp, old, adv, mask, clip_low=0.2, clip_high=0.2)
    # A=+1 and s > 1.2: clipped at -1.2 each, gradient 0.
    torch.testing.assert_close(loss, torch.tensor([[-1.2, -1.2]]))
    assert torch.equal(torch.autograd.grad(loss.sum(), logp)[0], torch.zeros(1, 2))
    assert m["clip_frac"] == 1 and m["clip_frac_high"] == 1
    torch.testing.assert_close(m["ratio_mean"], torch.tensor(math.sqrt(2)))
    # Wide clip: loss -A s = -sqrt 2 per token; GSPO-token gradient d/dlogp_t = -A s = -sqrt 2 per token.
    loss, _ = losses.gspo(logp, old, adv, mask, clip_low=0.9, clip_high=1.0)
    torch.testing.assert_close(loss, torch.full((1, 2), -math.sqrt(2)))
    torch.testing.assert_close(torch.autograd.grad(loss.sum(), logp)[0], torch.full((1, 2), -math.sqrt(2)))


def test_gspo_sequence_log_ratio_capped_at_10():
    loss, m = losses.gspo(
        torch.full((1, 2), 15.0),
        torch.zeros(1, 2),
        -torch.ones(1, 2),
        torch.ones(1, 2),
        clip_low=0.2,
        clip_high=0.2,
    )
    torch.testing.assert_close(loss, torch.full((1, 2), math.exp(10.0)))


def test_gspo_equals_loop():
    logp, old, adv, mask = _inputs(spread=0.3)
    loss, _ = losses.gspo(logp, old, adv, mask, clip_low=0.1, clip_high=0.15)
    expected = torch.zeros_like(old)
    for i in range(old.shape[0]):
        valid = [j for j in range(old.shape[1]) if mask[i, j]]
        if not valid:
            continue
        s = math.exp(min(sum(logp[i, j].item() - old[i, j].item() for j in valid) / len(valid), 10))
        for j in valid:
            a = adv[i, j].item()
            expected[i, j] = max(-a * s, -a * min(max(s, 0.9), 1.15))
    torch.testing.assert_close(loss, expected)


def test_gspo_gradcheck_sequence_objective():
    # With an advantage constant over each row, the GSPO-token gradient equals the gradient of the
    # sequence-level objective A * s_i (seq-mean-token-mean), so a numerical gradcheck holds.
    logp, old, _, mask = _inputs(spread=0.1)
    adv = torch.randn(
        old.shape[0], 1, dtype=torch.float64, generator=torch.Generator().manual_seed(9)
    ).expand_as(old)
    logp.requires_grad_()
    assert torch.autograd.gradcheck(
        lambda lp: losses.aggregate(
            losses.gspo(lp, old, adv, mask, clip_low=0.9, clip_high=5.0)[0], mask, "seq-mean-token-mean"
        ),
        (logp,),
    )


# ---------------------------------------------------------------- CISPO


def test_cispo_by_hand():
    # r = 1.5, A = 1, clip_high 0.2 -> w = 1.2; logp = -0.5 + log 1.5... use old = logp - log 1.5.
    logp = torch.tensor([[-0.5, -0.25]], requires_grad=True)
    old = logp.detach() - torch.log(torch.tensor([[1.5, 1.1]]))
    adv = torch.tensor([[1.0, -2.0]])
    loss, m = losses.cispo(logp, old, adv, torch.ones(1, 2), clip_low=0.2, clip_high=0.2)
    # token 0: -1.2 * 1 * -0.5 = 0.6; token 1: w = 1.1 (inside), -1.1 * -2 * -0.25 = -0.55.
    torch.testing.assert_close(loss, torch.tensor([[0.6, -0.55]]))
    # gradient -w A, even where the weight is clipped: [-1.2, 2.2].
    torch.testing.assert_close(torch.autograd.grad(loss.sum(), logp)[0], torch.tensor([[-1.2, 2.2]]))
    assert m["clip_frac"] == 0.5 and m["clip_frac_high"] == 0.5 and m["clip_frac_low"] == 0


def test_cispo_equals_loop_and_gradcheck_where_weights_are_clipped():
    logp, old, adv, mask = _inputs(spread=0.8)
    loss, _ = losses.cispo(logp, old, adv, mask, clip_low=0.5, clip_high=0.3)
    expected = torch.zeros_like(old)
    for i, j in mask.nonzero().tolist():
        w = min(max(math.exp(logp[i, j].item() - old[i, j].item()), 0.5), 1.3)
        expected[i, j] = -w * adv[i, j].item() * logp[i, j].item()
    torch.testing.assert_close(loss, expected)
    # Where every weight sits at a bound it is a constant, so the loss is smooth and gradcheck applies.
    far = old + 2.0
    assert torch.autograd.gradcheck(
        lambda lp: losses.aggregate(
            losses.cispo(lp, old, adv, mask, clip_low=0.5, clip_high=0.3)[0], mask, "token-mean"
        ),
        (far.clone().requires_grad_(),),
    )


# ---------------------------------------------------------------- aggregate


def test_aggregate_by_hand():
    x = torch.tensor([[1.0, 2.0, 3.0], [4.0, 9.0, 9.0], [7.0, 7.0, 7.0]])
    m = torch.tensor([[1, 1, 1], [1, 0, 0], [0, 0, 0]])
    # valid: row0 1+2+3 = 6 (3 tokens), row1 4 (1 token), row2 empty.
    assert losses.aggregate(x, m, "token-mean") == 10 / 4
    assert losses.aggregate(x, m, "seq-mean-token-sum") == (6 + 4) / 2
    assert losses.aggregate(x, m, "seq-mean-token-mean") == (6 / 3 + 4 / 1) / 2
    torch.testing.assert_close(losses.aggregate(x, m, "seq-mean-token-sum-norm"), torch.tensor(10 / (3 * 3)))
    torch.testing.assert_close(
        losses.aggregate(x, m, "seq-mean-token-sum-norm", norm_len=5), torch.tensor(10 / (3 * 5))
    )


def _aggregate_loop(x, m, mode, norm_len=None):
    rows = []
    for i in range(len(x)):
        vals = [x[i][j] for j in range(len(x[i])) if m[i][j]]
        rows.append(vals)
    tokens = [v for r in rows for v in r]
    nonempty = [r for r in rows if r]
    if mode == "token-mean":
        return sum(tokens) / len(tokens) if tokens else 0.0
    if mode == "seq-mean-token-sum":
        return sum(sum(r) for r in nonempty) / len(nonempty) if nonempty else 0.0
    if mode == "seq-mean-token-mean":
        return sum(sum(r) / len(r) for r in nonempty) / len(nonempty) if nonempty else 0.0
    return sum(tokens) / (len(x) * (norm_len or len(x[0])))


@pytest.mark.parametrize("mode", losses.AGG_MODES)
def test_aggregate_equals_loop_gradcheck_and_empty(mode):
    gen = torch.Generator().manual_seed(1)
    m = ragged_mask(6, 7, gen)
    x = torch.randn(6, 7, generator=gen, dtype=torch.float64)
    expected = _aggregate_loop(x.tolist(), m.tolist(), mode, 11)
    torch.testing.assert_close(
        losses.aggregate(x, m, mode, norm_len=11), torch.tensor(expected, dtype=torch.float64)
    )
    assert torch.autograd.gradcheck(
        lambda y: losses.aggregate(y, m, mode, norm_len=11), (x.clone().requires_grad_(),)
    )
    empty = losses.aggregate(x, torch.zeros_like(m), mode)
    assert empty == 0 and not empty.isnan()


@pytest.mark.parametrize("mode", losses.AGG_MODES)
def test_aggregate_global_denominators_make_micro_batches_sum_to_the_full_batch(mode):
    gen = torch.Generator().manual_seed(2)
    m = ragged_mask(11, 8, gen)
    m[7] = False  # a second empty row, inside a chunk
    x = torch.randn(11, 8, generator=gen, dtype=torch.float64)
    full = losses.aggregate(x, m, mode, norm_len=8)
    # Global denominators, computed once over the whole batch (as the learner's all-reduce would).
    num_tokens = m.sum()
    num_seqs = x.shape[0] if mode == "seq-mean-token-sum-norm" else (m.sum(1) > 0).sum()
    chunks = [(0, 3), (3, 4), (4, 9), (9, 11)]  # uneven row chunks
    total = sum(
        losses.aggregate(x[a:b], m[a:b], mode, norm_len=8, num_tokens=num_tokens, num_seqs=num_seqs)
        for a, b in chunks
    )
    torch.testing.assert_close(total, full, rtol=1e-12, atol=1e-12)
    # A padding micro-batch (mask all 0) adds exactly 0, whatever it holds.
    pad = losses.aggregate(
        torch.full((2, 8), float("nan")),
        torch.zeros(2, 8),
        mode,
        num_tokens=num_tokens,
        num_seqs=num_seqs,
        norm_len=8,
    )
    assert pad == 0
    # Without the global denominators the local means do NOT add up (why the arguments exist).
    local = sum(losses.aggregate(x[a:b], m[a:b], mode, norm_len=8) for a, b in chunks)
    assert not torch.allclose(local, full)


# ---------------------------------------------------------------- all losses: common behaviour

LOSSES = {
    "ppo_clip": lambda *a: losses.ppo_clip(*a, clip_low=0.2, clip_high=0.28, dual_clip=3.0),
    "gspo": lambda *a: losses.gspo(*a, clip_low=0.2, clip_high=0.2),
    "cispo": lambda *a: losses.cispo(*a, clip_low=0.2, clip_high=0.2),
}


@pytest.mark.parametrize("name", LOSSES)
@pytest.mark.parametrize("garbage", GARBAGE)
def test_losses_ignore_padding_garbage(name, garbage):
    logp, old, adv, mask = _inputs(seed=3, dtype=torch.float32)
    clean_lp = logp.clone().requires_grad_()
    dirty_lp = fill_padding(logp, mask, garbage).requires_grad_()
    clean, clean_m = LOSSES[name](clean_lp, old, adv, mask)
    dirty, dirty_m = LOSSES[name](
        dirty_lp, fill_padding(old, mask, garbage), fill_padding(adv, mask, garbage), mask
    )
    assert torch.equal(clean, dirty)
    for k in clean_m:
        assert torch.equal(clean_m[k], dirty_m[k]), k
    (g_clean,) = torch.autograd.grad(losses.aggregate(clean, mask, "token-mean"), clean_lp)
    (g_dirty,) = torch.autograd.grad(losses.aggregate(dirty, mask, "token-mean"), dirty_lp)
    assert torch.equal(g_clean, g_dirty)
    assert torch.equal(g_dirty[~mask], torch.zeros_like(g_dirty[~mask]))


@pytest.mark.parametrize("name", LOSSES)
def test_losses_empty_mask_gives_zeros(name):
    logp, old, adv, mask = _inputs(seed=4)
    loss, metrics = LOSSES[name](logp, old, adv, torch.zeros_like(mask))
    assert torch.equal(loss, torch.zeros_like(loss))
    for k, v in metrics.items():
        assert v.dim() == 0 and v == 0, k


@pytest.mark.parametrize("name", LOSSES)
def test_metrics_are_token_means_that_merge(name):
    # Metrics of two halves, weighted by their token counts, equal the metrics of the whole batch.
    logp, old, adv, mask = _inputs(seed=5)
    _, whole = LOSSES[name](logp, old, adv, mask)
    parts = [LOSSES[name](logp[s], old[s], adv[s], mask[s])[1] for s in (slice(0, 2), slice(2, None))]
    counts = [mask[:2].sum(), mask[2:].sum()]
    for k in whole:
        if k.endswith("_max"):
            merged = max(p[k] for p in parts)
        elif k.endswith("_min"):
            merged = min(p[k] for p in parts)
        else:
            merged = sum(p[k] * c for p, c in zip(parts, counts)) / sum(counts)
        torch.testing.assert_close(merged, whole[k], msg=k)


def test_invalid_arguments():
    logp, old, adv, mask = _inputs()
    with pytest.raises(ValueError, match=r"dual_clip=1\.0.*> 1"):
        losses.ppo_clip(logp, old, adv, mask, dual_clip=1.0)
    with pytest.raises(ValueError, match=r"clip_low=-0\.1"):
        losses.gspo(logp, old, adv, mask, clip_low=-0.1, clip_high=0.2)
    with pytest.raises(
        ValueError,
        match=r"mode='token_mean'.*'token-mean', 'seq-mean-token-sum', 'seq-mean-token-mean', 'seq-mean-token-sum-norm'",
    ):
        losses.aggregate(logp, mask, "token_mean")
    with pytest.raises(ValueError, match=r"norm_len=0"):
        losses.aggregate(logp, mask, "seq-mean-token-sum-norm", norm_len=0)
    with pytest.raises(ValueError, match=r"old_logp has shape"):
        losses.ppo_clip(logp, old[:, :3], adv, mask)


# -- value loss -------------------------------------------------------------------------------------


def test_value_loss_by_hand():
    v = torch.tensor([[1.0, 0.0, 2.0, -1.0]])
    old = torch.tensor([[0.0, 0.0, 1.9, 0.0]])
    ret = torch.tensor([[0.0, 1.0, 3.0, -1.0]])
    mask = torch.ones(1, 4, dtype=torch.bool)
    loss, metrics = losses.value_loss(v, old, ret, mask, clip=0.2)
    # v - R = 1, -1, -1, 0 -> unclipped 0.5 * (1, 1, 1, 0).
    # clipped predictions: 0 + 0.2, 0 + 0, 1.9 + 0.1, 0 - 0.2 -> errors 0.2, -1, -1, 0.8 -> 0.5 * (0.04, 1, 1, 0.64).
    # The pessimistic max takes the clipped branch only in the last token: 0.32 > 0.
    torch.testing.assert_close(loss, torch.tensor([[0.5, 0.5, 0.5, 0.32]]))
    torch.testing.assert_close(metrics["vf_clip_frac"], torch.tensor(0.25))
    torch.testing.assert_close(metrics["vf_error"], torch.tensor(0.75))  # mean |v - R| = (1+1+1+0)/4
    plain, _ = losses.value_loss(v, old, ret, mask, clip=None)
    torch.testing.assert_close(plain, torch.tensor([[0.5, 0.5, 0.5, 0.0]]))


@pytest.mark.parametrize("garbage", GARBAGE)
def test_value_loss_ignores_padding_and_leaves_inputs_alone(garbage):
    gen = torch.Generator().manual_seed(3)
    mask = ragged_mask(4, 6, gen)
    v, old, ret = (torch.randn(4, 6, generator=gen, dtype=torch.float64) for _ in range(3))
    clean, clean_m = losses.value_loss(v, old, ret, mask, clip=0.2)
    dirty_in = [fill_padding(x, mask, garbage).requires_grad_(i == 0) for i, x in enumerate((v, old, ret))]
    snapshot = [x.detach().clone() for x in dirty_in]
    dirty, dirty_m = losses.value_loss(*dirty_in, mask, clip=0.2)
    torch.testing.assert_close(dirty, clean)
    for k in clean_m:
        torch.testing.assert_close(dirty_m[k], clean_m[k])
    dirty.sum().backward()
    assert torch.isfinite(dirty_in[0].grad).all() and (dirty_in[0].grad[~mask] == 0).all()
    for x, s in zip(dirty_in, snapshot):
        assert torch.equal(x.detach().nan_to_num(), s.nan_to_num())


def test_value_loss_gradient_is_v_minus_r_unless_clipped():
    # Unclipped branch: d/dv 0.5 (v - R)^2 = v - R; clipped branch taken: 0 (the clip stops the gradient).
    v = torch.tensor([[0.3, 1.0]], dtype=torch.float64, requires_grad=True)
    old = torch.tensor([[0.25, 0.0]], dtype=torch.float64)
    ret = torch.tensor([[0.0, 2.0]], dtype=torch.float64)
    loss, _ = losses.value_loss(v, old, ret, torch.ones(1, 2, dtype=torch.bool), clip=0.2)
    loss.sum().backward()
    # token 0: |v - old| = 0.05 < clip, both branches equal -> gradient v - R = 0.3.
    # token 1: clipped prediction 0.2 is farther from R=2 (1.8^2 > 1.0^2) -> clipped branch, gradient 0.
    torch.testing.assert_close(v.grad, torch.tensor([[0.3, 0.0]], dtype=torch.float64))
    with pytest.raises(ValueError, match="clip"):
        losses.value_loss(v, old, ret, torch.ones(1, 2, dtype=torch.bool), clip=-1.0)
