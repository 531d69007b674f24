import math

import pytest
import torch
from algos_helpers import GARBAGE, fill_padding, ragged_mask

from rlkit.algos import correction

KEYS = {
    "rollout_is/mean",
    "rollout_is/max",
    "rollout_is/min",
    "rollout_is/std",
    "rollout_is/eff_sample_size",
    "rollout_is/fraction_high",
    "rollout_is/fraction_low",
    "rollout_is/masked_fraction",
    "rollout_is/seq_masked_fraction",
    "rollout_is/veto_fraction",
    "rollout_is/catastrophic_token_fraction",
}
MISMATCH_KEYS = {
    "mismatch/kl",
    "mismatch/k3_kl",
    "mismatch/training_ppl",
    "mismatch/rollout_ppl",
    "mismatch/log_ppl_diff",
    "mismatch/log_ppl_abs_diff",
    "mismatch/ppl_ratio",
    "mismatch/logprob_abs_diff",
}


def _token_case():
    # Token ratios train/rollout = [0.25, 1, 3]; upper 2 -> lower defaults to 1/2.
    rollout = torch.tensor([[-1.0, -2.0, -0.5]])
    train = rollout + torch.log(torch.tensor([[0.25, 1.0, 3.0]]))
    return train, rollout, torch.ones(1, 3, dtype=torch.bool)


def test_token_truncate_by_hand_with_metrics():
    w, m, metrics = correction.rollout_is(*_token_case(), level="token", mode="truncate", upper=2.0)
    torch.testing.assert_close(w, torch.tensor([[0.25, 1.0, 2.0]]))
    assert m.tolist() == [[True, True, True]]
    assert set(metrics) == KEYS
    # Before truncation: mean (0.25 + 1 + 3)/3, max 3, min 0.25; one above 2, one below 0.5.
    torch.testing.assert_close(metrics["rollout_is/mean"], torch.tensor(4.25 / 3))
    torch.testing.assert_close(metrics["rollout_is/max"], torch.tensor(3.0))
    torch.testing.assert_close(metrics["rollout_is/min"], torch.tensor(0.25))
    torch.testing.assert_close(metrics["rollout_is/fraction_high"], torch.tensor(1 / 3))
    torch.testing.assert_close(metrics["rollout_is/fraction_low"], torch.tensor(1 / 3))
    # Clamped to [0.5, 2]: [0.5, 1, 2]; E = 3.5/3, E[w^2] = 5.25/3.
    e, e2 = 3.5 / 3, 5.25 / 3
    torch.testing.assert_close(metrics["rollout_is/std"], torch.tensor(math.sqrt(e2 - e * e)))
    torch.testing.assert_close(metrics["rollout_is/eff_sample_size"], torch.tensor(e * e / e2))
    for k in ("masked_fraction", "seq_masked_fraction", "veto_fraction", "catastrophic_token_fraction"):
        assert metrics["rollout_is/" + k] == 0


def test_token_mask_and_both_by_hand():
    w, m, metrics = correction.rollout_is(*_token_case(), level="token", mode="mask", upper=2.0)
    torch.testing.assert_close(w, torch.tensor([[0.0, 1.0, 0.0]]))
    assert m.tolist() == [[False, True, False]]
    torch.testing.assert_close(metrics["rollout_is/masked_fraction"], torch.tensor(2 / 3))
    assert metrics["rollout_is/seq_masked_fraction"] == 1
    w2, m2, _ = correction.rollout_is(*_token_case(), level="token", mode="both", upper=2.0)
    assert torch.equal(w2, w) and torch.equal(m2, m)


def test_lower_defaults_to_one_over_upper_and_can_be_set():
    train, rollout, mask = _token_case()  # ratios [0.25, 1, 3]
    _, m, _ = correction.rollout_is(train, rollout, mask, mode="mask", upper=4.0)  # bounds [0.25, 4]
    assert m.tolist() == [[True, True, True]]
    _, m, _ = correction.rollout_is(train, rollout, mask, mode="mask", upper=4.0, lower=0.3)
    assert m.tolist() == [[False, True, True]]


def test_sequence_and_geometric_levels_by_hand():
    # Row 0 token ratios [2, 2] (row 1 [0.5, pad]): sequence ratio 4 and 0.5; geometric 2 and 0.5.
    rollout = torch.zeros(2, 2)
    train = torch.log(torch.tensor([[2.0, 2.0], [0.5, 1.0]]))
    mask = torch.tensor([[1, 1], [1, 0]])
    w, m, metrics = correction.rollout_is(train, rollout, mask, level="sequence", mode="truncate", upper=3.0)
    torch.testing.assert_close(w, torch.tensor([[3.0, 3.0], [0.5, 0.0]]))
    torch.testing.assert_close(metrics["rollout_is/mean"], torch.tensor((4 + 4 + 0.5) / 3))
    torch.testing.assert_close(metrics["rollout_is/fraction_high"], torch.tensor(2 / 3))
    w, m, metrics = correction.rollout_is(train, rollout, mask, level="sequence", mode="mask", upper=3.0)
    # bounds [1/3, 3]: row 0 (4) rejected whole, row 1 (0.5) kept.
    assert m.tolist() == [[False, False], [True, False]]
    torch.testing.assert_close(w, torch.tensor([[0.0, 0.0], [0.5, 0.0]]))
    torch.testing.assert_close(metrics["rollout_is/masked_fraction"], torch.tensor(2 / 3))
    torch.testing.assert_close(metrics["rollout_is/seq_masked_fraction"], torch.tensor(0.5))
    w, m, _ = correction.rollout_is(train, rollout, mask, level="geometric", mode="truncate", upper=1.5)
    torch.testing.assert_close(w, torch.tensor([[1.5, 1.5], [0.5, 0.0]]))


def test_veto_drops_whole_rows():
    rollout = torch.zeros(3, 3)
    train = torch.log(torch.tensor([[1.0, 1e-5, 1.0], [1.0, 1.0, 50.0], [1.1, 0.9, 1.0]]))
    mask = torch.tensor([[1, 1, 1], [1, 1, 0], [1, 1, 1]])  # the 50 sits at padding: no veto there
    w, m, metrics = correction.rollout_is(train, rollout, mask, veto_lower=1e-4, veto_upper=20.0)
    assert m.tolist() == [[False] * 3, [True, True, False], [True] * 3]
    assert torch.equal(w[0], torch.zeros(3))
    torch.testing.assert_close(metrics["rollout_is/veto_fraction"], torch.tensor(1 / 3))
    torch.testing.assert_close(metrics["rollout_is/catastrophic_token_fraction"], torch.tensor(1 / 8))
    torch.testing.assert_close(metrics["rollout_is/masked_fraction"], torch.tensor(3 / 8))
    _, m, _ = correction.rollout_is(train, rollout, mask.clone().fill_(1), veto_upper=20.0)
    assert m.tolist() == [[True] * 3, [False] * 3, [True] * 3]


def _rollout_is_loop(train, rollout, mask, level, mode, upper, lower, veto_lower, veto_upper):
    n, t = len(train), len(train[0])
    weights = [[0.0] * t for _ in range(n)]
    keep = [[False] * t for _ in range(n)]
    for i in range(n):
        valid = [j for j in range(t) if mask[i][j]]
        lrs = {j: train[i][j] - rollout[i][j] for j in valid}
        veto = any(
            (veto_lower is not None and math.exp(lrs[j]) < veto_lower)
            or (veto_upper is not None and math.exp(lrs[j]) > veto_upper)
            for j in valid
        )
        for j in valid:
            if level == "token":
                lr = lrs[j]
            elif level == "sequence":
                lr = sum(lrs.values())
            else:
                lr = sum(lrs.values()) / len(valid)
            w = math.exp(max(min(lr, 20), -20))
            rejected = mode != "truncate" and not (lower <= w <= upper)
            if veto or rejected:
                continue
            keep[i][j] = True
            weights[i][j] = w if mode == "mask" else min(w, upper)
    return weights, keep


@pytest.mark.parametrize("level", correction.LEVELS)
@pytest.mark.parametrize("mode", correction.MODES)
def test_rollout_is_equals_loop(level, mode):
    gen = torch.Generator().manual_seed(7)
    mask = ragged_mask(8, 6, gen)
    rollout = -torch.rand(8, 6, generator=gen, dtype=torch.float64) * 2
    train = rollout + 0.4 * torch.randn(8, 6, generator=gen, dtype=torch.float64)
    args = dict(level=level, mode=mode, upper=1.6, lower=0.7, veto_lower=0.35, veto_upper=None)
    w, m, _ = correction.rollout_is(train, rollout, mask, **args)
    ew, em = _rollout_is_loop(train.tolist(), rollout.tolist(), mask.tolist(), **args)
    torch.testing.assert_close(w, torch.tensor(ew, dtype=torch.float64))
    assert m.tolist() == em


@pytest.mark.parametrize("level", correction.LEVELS)
@pytest.mark.parametrize("mode", correction.MODES)
def test_weights_detached_zero_at_padding_and_garbage_free(level, mode):
    gen = torch.Generator().manual_seed(8)
    mask = ragged_mask(6, 5, gen)
    rollout = -torch.rand(6, 5, generator=gen)
    train = (rollout + 0.3 * torch.randn(6, 5, generator=gen)).requires_grad_()
    w, m, metrics = correction.rollout_is(train, rollout, mask, level=level, mode=mode, veto_lower=1e-3)
    assert not w.requires_grad and all(not v.requires_grad for v in metrics.values())
    assert set(metrics) == KEYS
    assert torch.equal(w[~m], torch.zeros_like(w[~m])) and not (m & ~mask).any()
    for garbage in GARBAGE:
        w2, m2, metrics2 = correction.rollout_is(
            fill_padding(train.detach(), mask, garbage),
            fill_padding(rollout, mask, -garbage),
            mask,
            level=level,
            mode=mode,
            veto_lower=1e-3,
        )
        assert torch.equal(w2, w) and torch.equal(m2, m)
        assert all(torch.equal(metrics2[k], metrics[k]) for k in KEYS)
    w, m, metrics = correction.rollout_is(train, rollout, torch.zeros_like(mask), level=level, mode=mode)
    assert not w.any() and not m.any() and all(v == 0 for v in metrics.values())


def test_invalid_arguments():
    t, r, m = _token_case()
    with pytest.raises(ValueError, match=r"level='seq'.*'token', 'sequence', 'geometric'"):
        correction.rollout_is(t, r, m, level="seq")
    with pytest.raises(ValueError, match=r"mode='clip'.*'truncate', 'mask', 'both'"):
        correction.rollout_is(t, r, m, mode="clip")
    with pytest.raises(ValueError, match=r"upper=2\.0 must be > lower=3\.0"):
        correction.rollout_is(t, r, m, upper=2.0, lower=3.0)
    with pytest.raises(ValueError, match=r"upper=0\.5 must be > lower=2\.0"):  # 1/upper > upper
        correction.rollout_is(t, r, m, upper=0.5)
    with pytest.raises(ValueError, match=r"veto_upper=1\.0 must be > veto_lower=2\.0"):
        correction.rollout_is(t, r, m, veto_lower=2.0, veto_upper=1.0)
    with pytest.raises(ValueError, match=r"kind='k5'"):
        correction.rollout_kl(t, r, kind="k5")


def test_mismatch_metrics_by_hand():
    # Row 0: train [-1, -3], rollout [-1.5, -2]; row 1: train [-2], rollout [-2] (+ padding); row 2 empty.
    train = torch.tensor([[-1.0, -3.0], [-2.0, 99.0], [5.0, 5.0]])
    rollout = torch.tensor([[-1.5, -2.0], [-2.0, float("nan")], [0.0, 0.0]])
    mask = torch.tensor([[1, 1], [1, 0], [0, 0]])
    got = correction.mismatch_metrics(train, rollout, mask)
    assert set(got) == MISMATCH_KEYS
    # token diffs rollout - train: [-0.5, 1, 0] -> kl = 0.5/3; |.| -> 1.5/3.
    torch.testing.assert_close(got["mismatch/kl"], torch.tensor(0.5 / 3))
    torch.testing.assert_close(got["mismatch/logprob_abs_diff"], torch.tensor(0.5))
    # k3 with lr = train - rollout = [0.5, -1, 0]: e^lr - lr - 1.
    k3 = (math.exp(0.5) - 1.5) + (math.exp(-1) + 1 - 1) + 0.0
    torch.testing.assert_close(got["mismatch/k3_kl"], torch.tensor(k3 / 3))
    # Row means: train [-2, -2], rollout [-1.75, -2]; empty row left out.
    torch.testing.assert_close(got["mismatch/training_ppl"], torch.tensor(math.exp(2.0)))
    torch.testing.assert_close(got["mismatch/rollout_ppl"], torch.tensor((math.exp(1.75) + math.exp(2)) / 2))
    torch.testing.assert_close(got["mismatch/log_ppl_diff"], torch.tensor(0.25 / 2))
    torch.testing.assert_close(got["mismatch/log_ppl_abs_diff"], torch.tensor(0.25 / 2))
    torch.testing.assert_close(got["mismatch/ppl_ratio"], torch.tensor((math.exp(0.25) + 1) / 2))
    empty = correction.mismatch_metrics(train, rollout, torch.zeros_like(mask))
    assert all(v == 0 for v in empty.values())


def test_rollout_kl_gradient_only_through_logp():
    gen = torch.Generator().manual_seed(0)
    logp = torch.randn(3, 4, generator=gen, dtype=torch.float64).requires_grad_()
    rollout = torch.randn(3, 4, generator=gen, dtype=torch.float64).requires_grad_()
    for kind in ("k1", "k2", "k3"):
        assert torch.autograd.gradcheck(
            lambda lp, kind=kind: correction.rollout_kl(lp, rollout, kind=kind), (logp,)
        )
    out = correction.rollout_kl(logp, rollout)  # k2 by default: d^2 / 2, gradient d
    torch.testing.assert_close(out, 0.5 * (logp - rollout).detach() ** 2)
    out.sum().backward()
    assert rollout.grad is None
    torch.testing.assert_close(logp.grad, (logp - rollout).detach())
