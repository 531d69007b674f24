import math

import pytest
import torch
from algos_helpers import GARBAGE, fill_padding, ragged_mask

from rlkit.algos import advantages

# ---------------------------------------------------------------- GRPO / Dr. GRPO


def test_grpo_by_hand():
    # Groups of 2: [1, 0] and [0, 1]. mean 0.5; unbiased std = sqrt((0.25 + 0.25) / 1) = sqrt(0.5).
    s = math.sqrt(0.5)
    a = 0.5 / (s + 1e-6)
    torch.testing.assert_close(
        advantages.grpo(torch.tensor([1.0, 0.0, 0.0, 1.0]), 2), torch.tensor([a, -a, -a, a])
    )
    # One group of 4: mean 0.5, unbiased std = sqrt(4 * 0.25 / 3) = sqrt(1/3).
    a4 = 0.5 / (math.sqrt(1 / 3) + 1e-6)
    torch.testing.assert_close(
        advantages.grpo(torch.tensor([1.0, 0.0, 0.0, 1.0]), 4), torch.tensor([a4, -a4, -a4, a4])
    )
    # Dr. GRPO: r - mean only.
    torch.testing.assert_close(
        advantages.grpo(torch.tensor([1.0, 0.0, 3.0, 1.0]), 2, norm_by_std=False),
        torch.tensor([0.5, -0.5, 1.0, -1.0]),
    )
    # eps sits outside the std: [2, 0] has std sqrt(2), A = 1 / (sqrt(2) + 0.5).
    torch.testing.assert_close(
        advantages.grpo(torch.tensor([2.0, 0.0]), 2, eps=0.5),
        torch.tensor([1 / (2**0.5 + 0.5), -1 / (2**0.5 + 0.5)]),
    )


def test_grpo_degenerate_groups_get_zero():
    assert torch.equal(advantages.grpo(torch.tensor([3.0, -1.0, 7.0]), 1), torch.zeros(3))
    assert torch.equal(advantages.grpo(torch.tensor([2.0, 2.0, 1.0, 0.0]), 2)[:2], torch.zeros(2))
    assert torch.equal(advantages.rloo(torch.tensor([3.0, -1.0]), 1), torch.zeros(2))


@pytest.mark.parametrize("group_size", [2, 3, 5])
@pytest.mark.parametrize("norm_by_std", [True, False])
def test_grpo_equals_loop(group_size, norm_by_std):
    gen = torch.Generator().manual_seed(group_size)
    rewards = torch.randn(4 * group_size, generator=gen, dtype=torch.float64)
    expected = []
    for start in range(0, len(rewards), group_size):
        group = rewards[start : start + group_size].tolist()
        mean = sum(group) / len(group)
        std = math.sqrt(sum((x - mean) ** 2 for x in group) / (len(group) - 1))
        expected += [(x - mean) / (std + 1e-6) if norm_by_std else x - mean for x in group]
    torch.testing.assert_close(
        advantages.grpo(rewards, group_size, norm_by_std=norm_by_std),
        torch.tensor(expected, dtype=torch.float64),
    )


# ---------------------------------------------------------------- RLOO


def test_rloo_by_hand():
    # [1, 0]: 1 - 0 = 1, 0 - 1 = -1. [2, 1]: 1, -1.
    torch.testing.assert_close(
        advantages.rloo(torch.tensor([1.0, 0.0, 2.0, 1.0]), 2), torch.tensor([1.0, -1.0, 1.0, -1.0])
    )
    # [3, 0, 0]: 3 - (0+0)/2 = 3; 0 - (3+0)/2 = -1.5.
    torch.testing.assert_close(
        advantages.rloo(torch.tensor([3.0, 0.0, 0.0]), 3), torch.tensor([3.0, -1.5, -1.5])
    )


@pytest.mark.parametrize("group_size", [2, 4])
def test_rloo_equals_loop(group_size):
    rewards = torch.randn(3 * group_size, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    expected = []
    for i, r in enumerate(rewards.tolist()):
        g = i // group_size
        others = [rewards[j].item() for j in range(g * group_size, (g + 1) * group_size) if j != i]
        expected.append(r - sum(others) / len(others))
    torch.testing.assert_close(
        advantages.rloo(rewards, group_size), torch.tensor(expected, dtype=torch.float64)
    )


# ---------------------------------------------------------------- zero-std groups


def test_zero_std_groups_by_hand_and_loop():
    rewards = torch.tensor([1.0, 1.0, 0.0, 1.0, 0.0, 0.0])
    assert advantages.zero_std_groups(rewards, 2).tolist() == [True, True, False, False, True, True]
    assert advantages.zero_std_groups(rewards, 3).tolist() == [False] * 6
    assert (
        advantages.zero_std_groups(rewards, 1).tolist() == [False] * 6
    )  # a group of one is never "zero std"
    r = torch.randint(0, 2, (40,), generator=torch.Generator().manual_seed(0)).float()
    loop = [len(set(r[(i // 4) * 4 : (i // 4) * 4 + 4].tolist())) == 1 for i in range(40)]
    assert advantages.zero_std_groups(r, 4).tolist() == loop


# ---------------------------------------------------------------- REINFORCE++


def _reinforce_pp_loop(rewards, mask, gamma):
    n, t = len(rewards), len(rewards[0])
    returns = [[0.0] * t for _ in range(n)]
    valid = []
    for i in range(n):
        running = 0.0
        for j in reversed(range(t)):
            if mask[i][j]:
                running = rewards[i][j] + gamma * running
                returns[i][j] = running
                valid.append(running)
    mean = sum(valid) / len(valid)
    var = sum((x - mean) ** 2 for x in valid) / (len(valid) - 1)
    return [
        [(returns[i][j] - mean) / math.sqrt(var + 1e-8) if mask[i][j] else 0.0 for j in range(t)]
        for i in range(n)
    ]


def test_reinforce_pp_by_hand():
    # Row 0: r=[0,0,1], m=[1,0,1], gamma=0.5: t2 -> 1; t1 skipped; t0 -> 0 + 0.5*1 = 0.5.
    # Row 1: r=[1,0,0], m=[1,1,0]: t1 -> 0; t0 -> 1 + 0.5*0 = 1.
    # Valid returns [0.5, 1, 1, 0]: mean 0.625; squared deviations sum 0.6875; unbiased var 0.6875/3.
    rewards = torch.tensor([[0.0, 0.0, 1.0], [1.0, 0.0, 0.0]])
    mask = torch.tensor([[1, 0, 1], [1, 1, 0]])
    std = math.sqrt(0.6875 / 3 + 1e-8)
    expected = torch.tensor([[-0.125 / std, 0.0, 0.375 / std], [0.375 / std, -0.625 / std, 0.0]])
    torch.testing.assert_close(advantages.reinforce_pp(rewards, mask, gamma=0.5), expected)


@pytest.mark.parametrize("gamma", [1.0, 0.9])
def test_reinforce_pp_equals_loop(gamma):
    gen = torch.Generator().manual_seed(3)
    mask = ragged_mask(7, 12, gen)
    rewards = torch.randn(7, 12, generator=gen, dtype=torch.float64)
    expected = torch.tensor(_reinforce_pp_loop(rewards.tolist(), mask.tolist(), gamma), dtype=torch.float64)
    torch.testing.assert_close(advantages.reinforce_pp(rewards, mask, gamma=gamma), expected)


def test_reinforce_pp_tiny_masks():
    assert torch.equal(advantages.reinforce_pp(torch.ones(2, 3), torch.zeros(2, 3)), torch.zeros(2, 3))
    one = torch.tensor([[0, 1, 0]], dtype=torch.bool)
    assert torch.equal(advantages.reinforce_pp(torch.ones(1, 3), one), torch.zeros(1, 3))


# ---------------------------------------------------------------- GAE


def _gae_loop(rewards, values, mask, gamma, lam):
    n, t = len(rewards), len(rewards[0])
    adv = [[0.0] * t for _ in range(n)]
    for i in range(n):
        valid = [j for j in range(t) if mask[i][j]]
        last = 0.0
        for k in reversed(range(len(valid))):
            j = valid[k]
            next_value = values[i][valid[k + 1]] if k + 1 < len(valid) else 0.0
            delta = rewards[i][j] + gamma * next_value - values[i][j]
            last = delta + gamma * lam * last
            adv[i][j] = last
    return adv


def test_gae_by_hand_interior_mask():
    # r=[0,0,1], V=[.5, 9, .5], m=[1,0,1] (the 9 sits at a masked position and must not matter).
    # gamma=1, lam=.5: A2 = 1 - .5 = .5; A0 = 0 + 1*.5 - .5 + .5*.5 = .25 (unmasked GAE would give 4.375).
    r = torch.tensor([[0.0, 0.0, 1.0]])
    v = torch.tensor([[0.5, 9.0, 0.5]])
    m = torch.tensor([[True, False, True]])
    adv, ret = advantages.gae(r, v, m, gamma=1.0, lam=0.5)
    torch.testing.assert_close(adv, torch.tensor([[0.25, 0.0, 0.5]]))
    torch.testing.assert_close(ret, torch.tensor([[0.75, 0.0, 1.0]]))
    # gamma=lam=1 telescopes: A_t = sum of later rewards - V_t -> A0 = 1 - .5, A2 = 1 - .5.
    adv, _ = advantages.gae(r, v, m)
    torch.testing.assert_close(adv, torch.tensor([[0.5, 0.0, 0.5]]))


@pytest.mark.parametrize(("gamma", "lam"), [(1.0, 1.0), (0.99, 0.95), (0.5, 0.0)])
def test_gae_equals_loop(gamma, lam):
    gen = torch.Generator().manual_seed(5)
    mask = ragged_mask(6, 10, gen)
    r = torch.randn(6, 10, generator=gen, dtype=torch.float64)
    v = torch.randn(6, 10, generator=gen, dtype=torch.float64)
    adv, ret = advantages.gae(r, v, mask, gamma=gamma, lam=lam)
    expected = torch.tensor(_gae_loop(r.tolist(), v.tolist(), mask.tolist(), gamma, lam), dtype=torch.float64)
    torch.testing.assert_close(adv, expected)
    torch.testing.assert_close(ret, torch.where(mask, expected + v, 0.0))


# ---------------------------------------------------------------- KL-shaped rewards


def test_kl_shaped_rewards_by_hand():
    # kl_coef 0.1: -0.1*kl on valid tokens, reward added at the last valid token (index 1, then index 2).
    kl = torch.tensor([[1.0, 2.0, 5.0], [1.0, 3.0, 4.0], [1.0, 1.0, 1.0]])
    mask = torch.tensor([[1, 1, 0], [1, 0, 1], [0, 0, 0]])
    out = advantages.kl_shaped_rewards(torch.tensor([1.0, 2.0, 3.0]), kl, mask, kl_coef=0.1)
    expected = torch.tensor([[-0.1, -0.2 + 1.0, 0.0], [-0.1, 0.0, -0.4 + 2.0], [0.0, 0.0, 0.0]])
    torch.testing.assert_close(out, expected)


def _slime_old_kl_shaped_rewards(rewards, kl, mask, kl_coef):
    """slime's pre-#2114 code, kept here to show the input-snapshot check catches aliasing."""
    for reward, k in zip(rewards, kl):
        k *= -kl_coef
        k[-1] += reward
    return kl


def test_kl_shaped_rewards_never_aliases_kl():
    gen = torch.Generator().manual_seed(0)
    rewards = torch.randn(4, generator=gen)
    mask = torch.ones(4, 5, dtype=torch.bool)
    kl = torch.rand(4, 5, generator=gen)

    # The check: snapshot the input, call, compare bit for bit. It FAILS on the old aliasing code ...
    snapshot = kl.clone()
    buggy_kl = kl.clone()
    _slime_old_kl_shaped_rewards(rewards, buggy_kl, mask, 0.1)
    assert not torch.equal(buggy_kl, snapshot)

    # ... and passes on ours, which also returns a fresh tensor (writing to it leaves kl intact).
    out = advantages.kl_shaped_rewards(rewards, kl, mask, kl_coef=0.1)
    assert torch.equal(kl, snapshot)
    out.add_(1.0)
    assert torch.equal(kl, snapshot)


def test_kl_shaped_rewards_equals_loop():
    gen = torch.Generator().manual_seed(2)
    mask = ragged_mask(6, 8, gen)
    kl = torch.randn(6, 8, generator=gen, dtype=torch.float64)
    rewards = torch.randn(6, generator=gen, dtype=torch.float64)
    expected = torch.zeros(6, 8, dtype=torch.float64)
    for i in range(6):
        valid = [j for j in range(8) if mask[i, j]]
        for j in valid:
            expected[i, j] = -0.05 * kl[i, j]
        if valid:
            expected[i, valid[-1]] += rewards[i]
    torch.testing.assert_close(advantages.kl_shaped_rewards(rewards, kl, mask, kl_coef=0.05), expected)


@pytest.mark.parametrize("garbage", GARBAGE)
def test_padding_garbage_never_leaks(garbage):
    gen = torch.Generator().manual_seed(4)
    mask = ragged_mask(5, 9, gen)
    r = torch.randn(5, 9, generator=gen)
    v = torch.randn(5, 9, generator=gen)
    dirty_r, dirty_v = fill_padding(r, mask, garbage), fill_padding(v, mask, garbage)
    assert torch.equal(advantages.reinforce_pp(dirty_r, mask), advantages.reinforce_pp(r, mask))
    for a, b in zip(
        advantages.gae(dirty_r, dirty_v, mask, gamma=0.9, lam=0.8),
        advantages.gae(r, v, mask, gamma=0.9, lam=0.8),
    ):
        assert torch.equal(a, b)
    rewards = torch.randn(5, generator=gen)
    assert torch.equal(
        advantages.kl_shaped_rewards(rewards, dirty_r, mask, kl_coef=0.1),
        advantages.kl_shaped_rewards(rewards, r, mask, kl_coef=0.1),
    )


def test_reinforce_pp_split_over_ranks_whitens_with_the_global_statistics():
    """Each 'rank' holds some rows; summing their masked_moments (what an all-reduce does) and
    whitening each share with that sum gives exactly the full-batch reinforce_pp."""
    gen = torch.Generator().manual_seed(7)
    mask = ragged_mask(7, 9, gen)
    rewards = torch.randn(7, 9, generator=gen, dtype=torch.float64)
    full = advantages.reinforce_pp(rewards, mask, gamma=0.9)
    shares = [slice(0, 3), slice(3, 4), slice(4, 7)]  # uneven, as ranks' rows after filtering
    returns = [advantages.discounted_returns(rewards[s], mask[s], gamma=0.9) for s in shares]
    total = sum(advantages.masked_moments(g, mask[s]) for g, s in zip(returns, shares))
    # By hand: the moments are (count, sum, sum of squares) of the full-batch returns' valid tokens.
    g_full = advantages.discounted_returns(rewards, mask, gamma=0.9)[mask]
    torch.testing.assert_close(
        total,
        torch.stack(
            [torch.tensor(float(g_full.numel()), dtype=torch.float64), g_full.sum(), (g_full**2).sum()]
        ),
    )
    split = torch.cat([advantages.whiten(g, mask[s], moments=total) for g, s in zip(returns, shares)])
    torch.testing.assert_close(split, full)
    # A share whitened with only its own statistics is not the full-batch result.
    assert not torch.allclose(advantages.whiten(returns[0], mask[shares[0]]), full[shares[0]])
