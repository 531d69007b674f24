"""Advantage estimators: GRPO / Dr. GRPO, RLOO, REINFORCE++, GAE, and PPO's KL-shaped token rewards.

Shapes: N samples, T response tokens; groups are the `group_size` contiguous samples of one prompt.
`mask` is bool or 0/1 and True on the response tokens that count; values at masked positions may be
anything (NaN, inf) and never reach a result. Nothing here writes to its arguments.
Results are float32 (float64 for float64 inputs) on the input's device.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Optional

import torch
from torch import Tensor

from rlkit.algos.common import as_bool_mask, as_float, check_groups, masked, safe_div
from rlkit.lookup import Registry

__all__ = [
    "grpo",
    "rloo",
    "reinforce_pp",
    "discounted_returns",
    "masked_moments",
    "whiten",
    "gae",
    "kl_shaped_rewards",
    "zero_std_groups",
    "overlong_penalty",
    "AdvantageInputs",
    "ESTIMATORS",
    "estimate",
]


def _groups(rewards: Tensor, group_size: int) -> Tensor:
    """[N] rewards -> [N / G, G] in the compute dtype, after checking that G divides N."""
    check_groups(rewards.shape[0], group_size)
    return as_float(rewards).reshape(-1, group_size)


def grpo(rewards: Tensor, group_size: int, *, norm_by_std: bool = True, eps: float = 1e-6) -> Tensor:
    """Group-relative advantages, one per sample.

    GRPO (Shao et al. 2024, "DeepSeekMath", arXiv:2402.03300): `(r - mean_g) / (std_g + eps)` with the
    unbiased (ddof=1) std of the sample's group and eps outside the std. `norm_by_std=False` is Dr. GRPO
    (Liu et al. 2025, "Understanding R1-Zero-Like Training", arXiv:2503.20783): `r - mean_g`, which removes
    the bias towards groups with a small reward spread. A group whose rewards are all equal gets exactly 0;
    a group of one gets 0 (it has no baseline to compare with).

    Args:
        rewards: [N] scalar reward per sample.
        group_size: G, samples per prompt; must divide N.
    Returns:
        [N] advantages.
    """
    r = _groups(rewards, group_size)
    if group_size == 1:
        return torch.zeros_like(r).reshape(-1)  # no baseline to compare with
    centred = r - r.mean(dim=1, keepdim=True)
    if norm_by_std:
        centred = centred / (r.std(dim=1, unbiased=True, keepdim=True) + eps)
    return centred.reshape(-1)


def rloo(rewards: Tensor, group_size: int) -> Tensor:
    """REINFORCE Leave-One-Out advantages (Ahmadian et al. 2024, "Back to Basics", arXiv:2402.14740).

    `A_i = r_i - mean_{j != i} r_j`, computed as `(r_i - mean_g) * G / (G - 1)`. A group of one gets 0.

    Args:
        rewards: [N]; group_size: G, must divide N.
    Returns:
        [N] advantages.
    """
    r = _groups(rewards, group_size)
    if group_size == 1:
        return torch.zeros_like(r).reshape(-1)  # no other sample to form the baseline
    return ((r - r.mean(dim=1, keepdim=True)) * (group_size / (group_size - 1))).reshape(-1)


def _masked_discounted_returns(rewards: Tensor, mask: Tensor, gamma: float) -> Tensor:
    """G_t = r_t + gamma * G_{next valid token}, skipping masked positions (0 there)."""
    returns = []
    running = torch.zeros_like(rewards[:, 0])
    for t in range(rewards.shape[1] - 1, -1, -1):
        # A masked position neither adds its reward nor discounts: the return is carried across it.
        running = torch.where(mask[:, t], rewards[:, t] + gamma * running, running)
        returns.append(running)
    return masked(torch.stack(returns[::-1], dim=1), mask)


def reinforce_pp(token_rewards: Tensor, mask: Tensor, *, gamma: float = 1.0) -> Tensor:
    """REINFORCE++ advantages (Hu 2025, "REINFORCE++", arXiv:2501.03262).

    Discounted returns over the valid tokens of each row, then whitened over all valid tokens of the
    batch: `(G - mean) * rsqrt(var + 1e-8)` with the unbiased variance. Masked positions are skipped
    (their reward is ignored and the return flows across them undiscounted), so an interior masked
    span (e.g. a tool observation) does not cut the credit from a final reward. This differs from
    verl, which resets the return at every masked position. For a batch split over ranks, whiten
    with the global statistics: `whiten(discounted_returns(...), mask, moments=sum of every rank's
    masked_moments(...))`.

    Args:
        token_rewards: [N, T] per-token rewards (e.g. from `kl_shaped_rewards`).
        mask: [N, T] bool or 0/1.
        gamma: discount.
    Returns:
        [N, T] advantages, 0 at padding; all 0 when the mask is empty.
    """
    return whiten(discounted_returns(token_rewards, mask, gamma=gamma), mask)


def discounted_returns(token_rewards: Tensor, mask: Tensor, *, gamma: float = 1.0) -> Tensor:
    """[N, T] discounted returns `G_t = r_t + gamma * G_next` over the valid tokens of each row
    (masked positions skipped, 0 at padding): REINFORCE++ before whitening."""
    m = as_bool_mask(mask, token_rewards)
    return _masked_discounted_returns(masked(as_float(token_rewards), m), m, gamma)


def masked_moments(x: Tensor, mask: Tensor) -> Tensor:
    """[3] (count, sum, sum of squares) of `x` over the valid tokens: summed over ranks (all-reduce),
    they give `whiten` the statistics of the global batch."""
    m = as_bool_mask(mask, x)
    v = masked(as_float(x), m)
    return torch.stack([m.sum().to(v.dtype), v.sum(), v.square().sum()])


def whiten(x: Tensor, mask: Tensor, *, moments: Tensor | None = None) -> Tensor:
    """`(x - mean) * rsqrt(var + 1e-8)` over the valid tokens, unbiased variance, 0 at padding.

    `moments`: (count, sum, sum of squares) of the whole batch when `x` is one rank's share of it
    (see `masked_moments`); None = this batch's own statistics, computed in two passes for accuracy.
    """
    m = as_bool_mask(mask, x)
    v = masked(as_float(x), m)
    if moments is None:
        n = m.sum().to(v.dtype)
        mean = safe_div(v.sum(), n)
        centred = masked(v - mean, m)
        # Unbiased variance; with one valid token the centred value is 0 anyway, so clamp n-1 to 1.
        var = centred.square().sum() / (n - 1).clamp(min=1)
    else:
        n, total, total_sq = moments.to(device=v.device, dtype=v.dtype).unbind()
        mean = safe_div(total, n)
        centred = masked(v - mean, m)
        var = (total_sq - n * mean.square()).clamp(min=0) / (n - 1).clamp(min=1)
    return masked(centred * torch.rsqrt(var + 1e-8), m)


def gae(
    token_rewards: Tensor, values: Tensor, mask: Tensor, *, gamma: float = 1.0, lam: float = 1.0
) -> tuple[Tensor, Tensor]:
    """Generalised Advantage Estimation (Schulman et al. 2016, "High-Dimensional Continuous Control
    Using Generalized Advantage Estimation", arXiv:1506.02438), mask-aware.

    `delta_t = r_t + gamma * V_next - V_t`, `A_t = delta_t + gamma * lam * A_next`, where "next" is the
    next *valid* token: masked positions are skipped (the value after a row's last valid token is 0), so
    values and rewards at padding or inside interior masked spans never matter. Not whitened.

    Args:
        token_rewards: [N, T]; values: [N, T] critic values; mask: [N, T] bool or 0/1.
    Returns:
        (advantages [N, T], returns [N, T] = advantages + values), both 0 at masked positions.
    """
    m = as_bool_mask(mask, token_rewards)
    if values.shape != token_rewards.shape:
        raise ValueError(f"values has shape {tuple(values.shape)}, expected {tuple(token_rewards.shape)}")
    r = masked(as_float(token_rewards), m)
    v = masked(as_float(values), m)
    dtype = torch.promote_types(r.dtype, v.dtype)
    r, v = r.to(dtype), v.to(dtype)
    next_value = torch.zeros_like(r[:, 0])
    last_gae = torch.zeros_like(r[:, 0])
    advs = []
    for t in range(r.shape[1] - 1, -1, -1):
        delta = r[:, t] + gamma * next_value - v[:, t]
        candidate = delta + gamma * lam * last_gae
        next_value = torch.where(m[:, t], v[:, t], next_value)
        last_gae = torch.where(m[:, t], candidate, last_gae)
        advs.append(last_gae)
    advantages = masked(torch.stack(advs[::-1], dim=1), m)
    return advantages, masked(advantages + v, m)


def kl_shaped_rewards(rewards: Tensor, kl: Tensor, mask: Tensor, *, kl_coef: float) -> Tensor:
    """PPO token rewards with a KL penalty (Ouyang et al. 2022 / Ziegler et al. 2019 style).

    A NEW tensor: `-kl_coef * kl` on valid tokens, 0 on padding, plus `rewards[i]` at row i's last valid
    token. `kl` is left untouched: it is logged afterwards (slime's old in-place
    `k *= kl_coef; k[-1] += reward` corrupted the logged KL). A row with no valid token gets all zeros
    (its reward has no token to sit on).

    Args:
        rewards: [N] sequence rewards; kl: [N, T] per-token KL estimate (see `rlkit.algos.kl`);
        mask: [N, T] bool or 0/1; kl_coef: penalty coefficient (float or 0-dim tensor).
    Returns:
        [N, T] token rewards.
    """
    m = as_bool_mask(mask, kl)
    if rewards.shape != kl.shape[:1]:
        raise ValueError(f"rewards has shape {tuple(rewards.shape)}, expected ({kl.shape[0]},)")
    k = as_float(kl)
    r = as_float(rewards).to(k.dtype)
    shaped = masked(-kl_coef * k, m)
    positions = torch.arange(m.shape[1], device=m.device)
    last = torch.where(m, positions, -1).amax(dim=1, keepdim=True)  # -1 for an empty row
    at_last = positions.unsqueeze(0) == last
    return shaped + torch.where(at_last, r.unsqueeze(1), torch.zeros((), dtype=k.dtype, device=k.device))


def zero_std_groups(rewards: Tensor, group_size: int) -> Tensor:
    """Which samples belong to a group with no reward spread (no learning signal under GRPO).

    Used to drop such groups from the loss (DAPO's dynamic sampling, Yu et al. 2025, arXiv:2503.14476,
    filters them out; rlkit masks them). Equality is exact.

    Args:
        rewards: [N]; group_size: G, must divide N.
    Returns:
        [N] bool, True for every sample of a group of two or more whose rewards are all equal;
        groups of one are False.
    """
    check_groups(rewards.shape[0], group_size)
    r = rewards.reshape(-1, group_size)
    if group_size == 1:
        return torch.zeros(rewards.shape, dtype=torch.bool, device=rewards.device)
    same = (r == r[:, :1]).all(dim=1, keepdim=True)
    return same.expand_as(r).reshape(-1)


def overlong_penalty(lengths: Tensor, max_len: int, buffer: int, penalty: float = 1.0) -> Tensor:
    """DAPO's soft overlong punishment (Yu et al. 2025, arXiv:2503.14476, eq. 13), one value per sample.

    0 while a response has at most `max_len - buffer` tokens, then falls linearly to `-penalty` at
    `max_len` tokens (and stays there beyond): `-penalty * min(1, (L - (max_len - buffer)) / buffer)`.

    Args:
        lengths: [N] response lengths in tokens (any numeric dtype).
        max_len: the generation cap (rollout.max_new_tokens).
        buffer: length of the linear zone before the cap, 1 <= buffer <= max_len.
        penalty: the penalty at the cap, >= 0.
    Returns:
        [N] float32 (a new tensor; <= 0).
    """
    if not isinstance(buffer, int) or isinstance(buffer, bool) or not 1 <= buffer <= max_len:
        raise ValueError(f"buffer={buffer!r} is not valid; it must be an integer in [1, max_len={max_len}]")
    if penalty < 0:
        raise ValueError(f"penalty={penalty!r} is not valid; it must be >= 0")
    over = (lengths.float() - (max_len - buffer)).clamp(min=0) / buffer
    return -penalty * over.clamp(max=1.0)


# -- the registry of estimators (algo.adv_estimator) ---------------------------------------------------------


@dataclass(frozen=True)
class AdvantageInputs:
    """What a step hands every estimator (this rank's rows; groups contiguous)."""

    rewards: Tensor
    """[N] total reward of each sample."""
    mask: Tensor
    """[N, T] bool, the response tokens."""
    group_size: int
    kl: Tensor | None = None
    """[N, T] per-token KL to the reference when it goes into the reward (`algo.kl_in_reward`), else None."""
    kl_coef: float = 0.0
    """The coefficient of `kl` in the token rewards."""
    values: Tensor | None = None
    """[N, T] critic values at rollout time (estimators registered with `needs_critic=True`)."""
    global_sum: Callable[[Tensor], Tensor] | None = None
    """Sums a tensor over ranks (batch-global statistics); None with one process."""

    def token_rewards(self) -> Tensor:
        """[N, T]: -kl_coef * kl on valid tokens plus each reward at its row's last valid token."""
        kl = self.kl if self.kl is not None else torch.zeros(self.mask.shape, device=self.rewards.device)
        return kl_shaped_rewards(
            self.rewards, kl, self.mask, kl_coef=self.kl_coef if self.kl is not None else 0.0
        )


# Each entry: fn(inputs: AdvantageInputs, params) -> (advantages [N, T], returns [N, T] or None), `params`
# being the algo config (norm_by_std, gamma, lam, ...). Properties the config rules read:
#   group_based   the advantage compares the samples of a group (dynamic sampling filters groups for it)
#   token_level   it takes token rewards (so the KL can go into the reward: algo.kl_in_reward)
#   needs_critic  it needs a value model (algo.value_model=true)
AdvantageFn = Callable[[AdvantageInputs, Any], tuple[Tensor, Optional[Tensor]]]
ESTIMATORS: Registry[AdvantageFn] = Registry("algo.adv_estimator")


@ESTIMATORS.register("grpo", group_based=True, token_level=False, needs_critic=False)
def _grpo(inputs: AdvantageInputs, params) -> tuple[Tensor, None]:
    seq = grpo(inputs.rewards, inputs.group_size, norm_by_std=params.norm_by_std)
    return seq[:, None] * inputs.mask, None


@ESTIMATORS.register("rloo", group_based=True, token_level=False, needs_critic=False)
def _rloo(inputs: AdvantageInputs, params) -> tuple[Tensor, None]:
    return rloo(inputs.rewards, inputs.group_size)[:, None] * inputs.mask, None


@ESTIMATORS.register("reinforce_pp", group_based=False, token_level=True, needs_critic=False)
def _reinforce_pp(inputs: AdvantageInputs, params) -> tuple[Tensor, None]:
    # Whitened over the global batch: with several ranks every rank uses the moments summed over all ranks.
    discounted = discounted_returns(inputs.token_rewards(), inputs.mask, gamma=params.gamma)
    moments = None
    if inputs.global_sum is not None:
        moments = inputs.global_sum(masked_moments(discounted, inputs.mask))
    return whiten(discounted, inputs.mask, moments=moments), None


@ESTIMATORS.register("gae", group_based=False, token_level=True, needs_critic=True)
def _gae(inputs: AdvantageInputs, params) -> tuple[Tensor, Tensor]:
    return gae(inputs.token_rewards(), inputs.values, inputs.mask, gamma=params.gamma, lam=params.lam)


def estimate(name: str, inputs: AdvantageInputs, params) -> tuple[Tensor, Tensor | None]:
    """(advantages [N, T], returns [N, T] or None) of the registered estimator `name`."""
    return ESTIMATORS.get_checked(name)(inputs, params)
