import math

import pytest
import torch

from rlkit.algos import kl


def test_estimators_by_hand():
    logp = torch.tensor([0.0, 1.0, -1.0, -30.0])
    ref = torch.zeros(4)  # d = logp - ref = [0, 1, -1, -30]
    torch.testing.assert_close(kl.kl_estimate(logp, ref, "k1"), torch.tensor([0.0, 1.0, -1.0, -30.0]))
    torch.testing.assert_close(kl.kl_estimate(logp, ref, "abs"), torch.tensor([0.0, 1.0, 1.0, 30.0]))
    torch.testing.assert_close(kl.kl_estimate(logp, ref, "k2"), torch.tensor([0.0, 0.5, 0.5, 450.0]))
    # k3 = exp(-d) + d - 1: d=1 -> e^-1; d=-1 -> e - 2; d=-30 -> exponent 30 clamped to 20: e^20 - 31.
    expected = torch.tensor([0.0, math.exp(-1), math.e - 2, math.exp(20) - 31])
    torch.testing.assert_close(kl.kl_estimate(logp, ref, "k3"), expected)


@pytest.mark.parametrize("kind", kl.KINDS)
def test_gradcheck(kind):
    gen = torch.Generator().manual_seed(0)
    # Keep d away from 0, where |d| has a kink.
    logp = (torch.rand(3, 4, generator=gen, dtype=torch.float64) + 0.1).requires_grad_()
    ref = (-torch.rand(3, 4, generator=gen, dtype=torch.float64)).requires_grad_()
    assert torch.autograd.gradcheck(lambda a, b: kl.kl_estimate(a, b, kind), (logp, ref))


def test_k3_is_non_negative_and_unbiased_direction():
    d = torch.linspace(-5, 5, 101)
    assert (kl.kl_estimate(d, torch.zeros_like(d), "k3") >= 0).all()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float64])
def test_dtypes(dtype):
    logp = torch.tensor([-1.0, -2.0], dtype=dtype)
    ref = torch.tensor([-1.5, -1.0], dtype=dtype)
    out = kl.kl_estimate(logp, ref, "k3")
    assert out.dtype == (torch.float64 if dtype == torch.float64 else torch.float32)
    expected = [math.exp(-0.5) + 0.5 - 1, math.exp(1.0) - 1 - 1]
    torch.testing.assert_close(out, torch.tensor(expected, dtype=out.dtype))


def test_unknown_kind():
    with pytest.raises(ValueError, match=r"kind='k4'.*'k1', 'abs', 'k2', 'k3'"):
        kl.kl_estimate(torch.zeros(2), torch.zeros(2), "k4")
