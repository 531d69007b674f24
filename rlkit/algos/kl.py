"""Per-token KL estimators (Schulman 2020, "Approximating KL Divergence",
http://joschu.net/blog/kl-approx.html).

With tokens sampled from the current policy and `d = logp - ref_logp`, each estimates KL(policy || ref):
- `k1 = d`: unbiased, high variance, can be negative per token. Its gradient is 1 (as a loss term it only
  pushes log-probs down uniformly): use it in the reward (PPO `kl_shaped_rewards`), where it is unbiased.
- `abs = |d|`: a biased but non-negative variant of k1.
- `k2 = d^2 / 2`: low variance, biased; its gradient `d` is the gradient of the true KL for on-policy
  samples, so it is the right choice for a KL *loss* term and for `rollout_kl`.
- `k3 = exp(-d) + d - 1`: unbiased and non-negative, low variance (GRPO's KL loss, DeepSeekMath). The
  exponent is clamped to +-20 so a single token with a huge log-ratio cannot overflow.
"""

from __future__ import annotations

import torch
from torch import Tensor

from rlkit.algos.common import EXP_CLAMP, as_float, check_choice
from rlkit.lookup import Registry

__all__ = ["ESTIMATORS", "KINDS", "kl_estimate"]

# Per-token KL estimators of d = logp - ref_logp (algo.kl_estimator, algo.rollout_kl_estimator).
ESTIMATORS = Registry("algo.kl_estimator")
ESTIMATORS.register("k1")(lambda d: d)
ESTIMATORS.register("abs")(lambda d: d.abs())
ESTIMATORS.register("k2")(lambda d: 0.5 * d.square())
ESTIMATORS.register("k3")(lambda d: torch.exp((-d).clamp(-EXP_CLAMP, EXP_CLAMP)) + d - 1)
KINDS = tuple(ESTIMATORS)


def kl_estimate(logp: Tensor, ref_logp: Tensor, kind: str) -> Tensor:
    """Per-token KL estimate of kind `k1`, `abs`, `k2` or `k3` (see the module docstring).

    Args:
        logp: [...] log-probs under the policy (gradient flows through both inputs).
        ref_logp: [...] log-probs of the same tokens under the reference.
        kind: one of `KINDS`.
    Returns:
        same shape as `logp`, float32 (float64 for float64 inputs). No mask: padding positions hold
        whatever the inputs give; aggregate with `rlkit.algos.losses.aggregate`, which ignores them.
    """
    check_choice("kind", kind, KINDS)
    if logp.shape != ref_logp.shape:
        raise ValueError(f"ref_logp has shape {tuple(ref_logp.shape)}, expected {tuple(logp.shape)}")
    dtype = torch.promote_types(as_float(logp).dtype, as_float(ref_logp).dtype)
    return ESTIMATORS[kind](logp.to(dtype) - ref_logp.to(dtype))
