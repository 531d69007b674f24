"""On-policy distillation's math (rlkit/algos/distill.py) against hand computations and naive loops."""

import math

import pytest
import torch
from algos_helpers import GARBAGE, fill_padding, ragged_mask

from rlkit.algos import advantages, distill


def test_the_term_by_hand():
    # Two rows, three tokens; the second row's last token is padding.
    logp = torch.log(torch.tensor([[0.5, 0.25, 0.8], [0.1, 0.9, 0.3]]))
    teacher = torch.log(torch.tensor([[0.25, 0.25, 0.4], [0.2, 0.45, 0.7]]))
    mask = torch.tensor([[True, True, True], [True, True, False]])
    # -(log p - log q) = log(q / p): log 0.5, log 1, log 0.5 ; log 2, log 0.5, (padding) 0
    want = torch.tensor([[math.log(0.5), 0.0, math.log(0.5)], [math.log(2.0), math.log(0.5), 0.0]])
    torch.testing.assert_close(distill.distill_advantages(logp, teacher, mask), want)
    torch.testing.assert_close(distill.reverse_kl(logp, teacher, mask), -want)
    # gamma = 1: each token carries the rest of its row's sum: row 0: 2 log .5, log .5, log .5; row 1: log 2 +
    # log .5 = 0, log .5, 0.
    want_g1 = torch.tensor([[2 * math.log(0.5), math.log(0.5), math.log(0.5)], [0.0, math.log(0.5), 0.0]])
    torch.testing.assert_close(distill.distill_advantages(logp, teacher, mask, gamma=1.0), want_g1)
    # gamma = 0.5: row 0 = [l + .5 (0 + .5 l), 0 + .5 l, l] with l = log .5.
    lh = math.log(0.5)
    want_half = torch.tensor([[lh + 0.25 * lh, 0.5 * lh, lh], [math.log(2.0) + 0.5 * lh, lh, 0.0]])
    torch.testing.assert_close(distill.distill_advantages(logp, teacher, mask, gamma=0.5), want_half)


def test_the_term_is_zero_when_the_teacher_is_the_policy_and_carries_no_gradient():
    gen = torch.Generator().manual_seed(0)
    logp = torch.log_softmax(torch.randn(4, 6, generator=gen), -1).requires_grad_(True)
    mask = ragged_mask(4, 6, gen)
    d = distill.distill_advantages(logp, logp.detach().clone(), mask)
    assert torch.equal(d, torch.zeros_like(d))
    assert not d.requires_grad
    teacher = torch.randn(4, 6, generator=gen, requires_grad=True)
    assert not distill.distill_advantages(logp, teacher, mask, gamma=1.0).requires_grad


def test_discounted_term_equals_a_naive_loop_and_skips_masked_positions():
    gen = torch.Generator().manual_seed(1)
    n, t, gamma = 5, 9, 0.7
    mask = ragged_mask(n, t, gen)
    logp = torch.randn(n, t, generator=gen, dtype=torch.float64)
    teacher = torch.randn(n, t, generator=gen, dtype=torch.float64)
    want = torch.zeros(n, t, dtype=torch.float64)
    for i in range(n):
        running = 0.0
        for j in reversed(range(t)):
            if mask[i, j]:
                running = -(float(logp[i, j]) - float(teacher[i, j])) + gamma * running
                want[i, j] = running
    got = distill.distill_advantages(
        fill_padding(logp, mask, float("nan")), fill_padding(teacher, mask, float("inf")), mask, gamma=gamma
    )
    torch.testing.assert_close(got, want)


@pytest.mark.parametrize("garbage", GARBAGE)
def test_padding_values_never_reach_the_result(garbage):
    gen = torch.Generator().manual_seed(2)
    mask = ragged_mask(4, 7, gen)
    logp, teacher = torch.randn(4, 7, generator=gen), torch.randn(4, 7, generator=gen)
    clean = distill.distill_advantages(logp, teacher, mask, gamma=1.0)
    dirty = distill.distill_advantages(
        fill_padding(logp, mask, garbage), fill_padding(teacher, mask, garbage), mask, gamma=1.0
    )
    assert torch.equal(clean, dirty)


def test_combined_with_grpo_by_hand():
    # One group of 2: rewards [1, 0] -> GRPO sequence advantages [a, -a] broadcast over each row's tokens.
    rewards = torch.tensor([1.0, 0.0])
    a = 0.5 / (math.sqrt(0.5) + 1e-6)
    seq = advantages.grpo(rewards, 2)
    d = torch.tensor([[0.1, -0.2], [0.3, 0.0]])
    mask = torch.tensor([[True, True], [True, False]])
    got = distill.combine(seq, d, mask, task_coef=1.0, distill_coef=0.5)
    want = torch.tensor([[a + 0.05, a - 0.1], [-a + 0.15, 0.0]])
    torch.testing.assert_close(got, want)
    # [N, T] task advantages (the registry's shape) give the same, and task_coef=0 is pure distillation.
    torch.testing.assert_close(distill.combine(seq[:, None] * mask, d, mask, distill_coef=0.5), want)
    torch.testing.assert_close(
        distill.combine(seq, d, mask, task_coef=0.0, distill_coef=2.0),
        torch.tensor([[0.2, -0.4], [0.6, 0.0]]),
    )


def test_metrics_by_hand():
    logp = torch.log(torch.tensor([[0.5, 0.25], [0.1, 0.9]]))
    teacher = torch.log(torch.tensor([[0.25, 0.25], [0.2, 0.9]]))
    mask = torch.tensor([[True, True], [True, False]])
    task = torch.tensor([[1.0, 1.0], [-3.0, 7.0]])
    dpart = torch.tensor([[-0.5, 0.0], [0.25, 9.0]])
    m = distill.distill_metrics(logp, teacher, task, dpart, mask)
    # three valid tokens: reverse KL log 2, 0, log .5 -> mean 0; teacher log-probs log .25 twice and log .2
    torch.testing.assert_close(m["distill/reverse_kl"], torch.tensor(0.0), atol=1e-7, rtol=0)
    torch.testing.assert_close(
        m["distill/teacher_logprob"], torch.tensor((2 * math.log(0.25) + math.log(0.2)) / 3)
    )
    torch.testing.assert_close(m["distill/adv_abs"], torch.tensor(0.75 / 3))
    torch.testing.assert_close(m["distill/task_adv_abs"], torch.tensor(5.0 / 3))
    share = distill.teacher_share(m["distill/adv_abs"], m["distill/task_adv_abs"])
    torch.testing.assert_close(share, torch.tensor(0.75 / (0.75 + 5.0)))
    assert distill.teacher_share(torch.tensor(0.0), torch.tensor(0.0)) == 0


def test_inputs_are_not_written():
    gen = torch.Generator().manual_seed(3)
    logp, teacher = torch.randn(3, 5, generator=gen), torch.randn(3, 5, generator=gen)
    mask = ragged_mask(3, 5, gen)
    copies = [x.clone() for x in (logp, teacher, mask)]
    distill.distill_advantages(logp, teacher, mask, gamma=0.9)
    distill.combine(torch.randn(3, generator=gen), teacher, mask)
    for x, c in zip((logp, teacher, mask), copies):
        assert torch.equal(x, c)
    with pytest.raises(ValueError, match="gamma"):
        distill.distill_advantages(logp, teacher, mask, gamma=1.5)
