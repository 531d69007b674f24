"""Policy losses and loss aggregation.

Each policy loss returns `(per_token_loss [N, T], metrics)`: the loss is 0 at padding and its gradient
flows only through `logp`; `metrics` maps names to detached 0-dim tensors, each a mean over the valid
tokens (keys ending in `_max`/`_min` are a max/min over them), so the learner merges micro-batches with
`rlkit.metrics.MetricMerger` weighted by `mask.sum()`. Metrics of an empty mask are 0.

Metric keys (all three losses): `clip_frac` (tokens whose gradient is cut by the clip), `clip_frac_high`
(cut at the upper bound), `clip_frac_low` (cut at the lower bound), `ratio_mean`, `ratio_max`,
`ratio_min` (the importance ratio the loss uses: per token, or the sequence ratio for GSPO),
`approx_kl` (k1: mean of `old_logp - logp`, an estimate of KL(old || new); verl's `ppo_kl`) and
`approx_kl_k3` (mean of `r - 1 - log r`, non-negative, lower variance). `ppo_clip` adds `dual_clip_frac`
(0 when dual clip is off).

Inputs may be float32, bfloat16 or float64; the math runs in float32 (float64 for float64 inputs).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from rlkit.algos.common import EXP_CLAMP, as_bool_mask, as_float, check_choice, masked, safe_div
from rlkit.lookup import Registry

__all__ = [
    "AGG_MODES",
    "POLICY_LOSSES",
    "ppo_clip",
    "gspo",
    "cispo",
    "nll",
    "value_loss",
    "aggregate",
    "policy_loss",
]

AGG_MODES = ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm")
# GSPO's sequence log-ratio is capped lower than a token's: it multiplies every token of the row.
_GSPO_LOG_RATIO_MAX = 10.0


def _prepare(logp, old_logp, advantages, mask, clip_low, clip_high):
    """Validate; return (bool mask, logp, old_logp, advantages) in one float dtype, padding zeroed."""
    m = as_bool_mask(mask, logp)
    for name, x in (("old_logp", old_logp), ("advantages", advantages)):
        if x.shape != logp.shape:
            raise ValueError(f"{name} has shape {tuple(x.shape)}, expected {tuple(logp.shape)} like logp")
    for name, value in (("clip_low", clip_low), ("clip_high", clip_high)):
        if not value >= 0:
            raise ValueError(f"{name}={value!r} is not valid; it must be a number >= 0")
    dtype = torch.promote_types(as_float(logp).dtype, as_float(old_logp).dtype)
    # Zero the padding first: garbage there must not reach the value nor (through 0 * NaN) the gradient.
    return (
        m,
        masked(logp.to(dtype), m),
        masked(old_logp.to(dtype).detach(), m),
        masked(advantages.to(dtype).detach(), m),
    )


def _masked_mean(x: Tensor, m: Tensor, n: Tensor) -> Tensor:
    return safe_div(masked(x.to(n.dtype), m).sum(), n)


def _masked_extreme(x: Tensor, m: Tensor, n: Tensor, largest: bool) -> Tensor:
    fill = torch.full((1,), float("-inf") if largest else float("inf"), dtype=x.dtype, device=x.device)
    # The extra fill element keeps amax/amin defined for a batch with zero rows.
    v = torch.cat([torch.where(m, x, fill).flatten(), fill])
    v = v.amax() if largest else v.amin()
    return torch.where(n > 0, v, torch.zeros_like(v))


def _ratio_metrics(ratio: Tensor, log_ratio: Tensor, m: Tensor, n: Tensor) -> dict[str, Tensor]:
    """ratio = new/old per token (its log is `log_ratio`)."""
    return {
        "ratio_mean": _masked_mean(ratio, m, n),
        "ratio_max": _masked_extreme(ratio, m, n, largest=True),
        "ratio_min": _masked_extreme(ratio, m, n, largest=False),
        "approx_kl": _masked_mean(-log_ratio, m, n),
        "approx_kl_k3": _masked_mean(torch.expm1(log_ratio) - log_ratio, m, n),
    }


def _clipped_surrogate(ratio, adv, clip_low, clip_high):
    """PPO's pessimistic surrogate max(-A r, -A clip(r)); returns (loss, clip_active, clipped_high)."""
    unclipped = -adv * ratio
    clipped = -adv * ratio.clamp(1 - clip_low, 1 + clip_high)
    # Where the clipped branch is strictly larger the gradient is 0 (the clamp is flat there).
    active = clipped > unclipped
    return torch.where(active, clipped, unclipped), active, active & (ratio > 1 + clip_high)


def ppo_clip(
    logp: Tensor,
    old_logp: Tensor,
    advantages: Tensor,
    mask: Tensor,
    *,
    clip_low: float = 0.2,
    clip_high: float = 0.2,
    dual_clip: float | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """PPO clipped surrogate (Schulman et al. 2017, arXiv:1707.06347) with clip-higher and dual clip.

    `r = exp(clamp(logp - old_logp, -20, 20))`, `loss = max(-A r, -A clip(r, 1 - clip_low, 1 + clip_high))`.
    Decoupled bounds (`clip_high > clip_low`) are DAPO's clip-higher (Yu et al. 2025, arXiv:2503.14476).
    `dual_clip=c > 1` (Ye et al. 2020, "Mastering Complex Control in MOBA Games", arXiv:1912.09729) caps
    tokens with A < 0 at `-A c`, so a huge ratio on a bad token cannot blow up the loss.
    d loss / d logp = -A r where the clip is inactive, exactly 0 where a clip (or the +-20 clamp) is active.
    When `old_logp` is `logp.detach()` (one optimizer step per batch, rlkit's default: algo.ppo_epochs =
    algo.mini_batches = 1), r = 1 exactly and no clip ever acts: the gradient is -A d logp, REINFORCE with the
    estimator's baseline (GRPO: the group mean); the clip matters with several optimizer steps per batch, and
    the train/rollout drift is corrected by rollout IS weights (rlkit.algos.correction), not by this ratio.

    Args:
        logp: [N, T] current log-probs (with grad); old_logp: [N, T] log-probs of the behaviour policy;
        advantages: [N, T]; mask: [N, T] bool or 0/1.
    Returns:
        (per_token_loss [N, T], metrics); see the module docstring for the keys.
    """
    if dual_clip is not None and not dual_clip > 1:
        raise ValueError(f"dual_clip={dual_clip!r} is not valid; use None (off) or a number > 1")
    m, logp, old, adv = _prepare(logp, old_logp, advantages, mask, clip_low, clip_high)
    log_ratio = (logp - old).clamp(-EXP_CLAMP, EXP_CLAMP)
    ratio = torch.exp(log_ratio)
    loss, active, active_high = _clipped_surrogate(ratio, adv, clip_low, clip_high)
    dual_active = torch.zeros_like(m)
    if dual_clip is not None:
        cap = -adv * dual_clip
        dual_active = (adv < 0) & (loss > cap)
        loss = torch.where(dual_active, cap, loss)
    n = m.sum().to(ratio.dtype)
    with torch.no_grad():
        metrics = {
            "clip_frac": _masked_mean(active | dual_active, m, n),
            "clip_frac_high": _masked_mean(active_high, m, n),
            "clip_frac_low": _masked_mean(active & ~active_high, m, n),
            "dual_clip_frac": _masked_mean(dual_active, m, n),
            **_ratio_metrics(ratio, log_ratio, m, n),
        }
    return masked(loss, m), metrics


def gspo(
    logp: Tensor, old_logp: Tensor, advantages: Tensor, mask: Tensor, *, clip_low: float, clip_high: float
) -> tuple[Tensor, dict[str, Tensor]]:
    """Group Sequence Policy Optimization (Zheng et al. 2025, arXiv:2507.18071), GSPO-token form.

    Sequence ratio `s_i = exp(min(mean_t (logp - old_logp) over row i's valid tokens, 10))` (a geometric
    mean of the token ratios, so the ratio does not grow with length), used for every token of the row
    as `sg(s_i) * exp(logp_t - sg(logp_t))`: its value is `s_i` and d/d logp_t is `s_i` (GSPO-token);
    with an advantage that is constant over the row this equals GSPO's sequence-level gradient. Then the
    PPO clip on `s_i`. The paper's clip ranges are tiny (about 3e-4 / 4e-4), not PPO's 0.2; aggregate with
    `seq-mean-token-mean` for the paper's objective.

    Args / Returns: as `ppo_clip` (without dual clip); `ratio_*` metrics are the sequence ratio per token.
    """
    m, logp, old, adv = _prepare(logp, old_logp, advantages, mask, clip_low, clip_high)
    lengths = m.sum(dim=1, keepdim=True).to(logp.dtype)
    seq_log_ratio = safe_div((logp - old).sum(dim=1, keepdim=True), lengths).detach()
    log_ratio = (logp - logp.detach() + seq_log_ratio).clamp(max=_GSPO_LOG_RATIO_MAX)
    ratio = torch.exp(log_ratio)
    loss, active, active_high = _clipped_surrogate(ratio, adv, clip_low, clip_high)
    n = m.sum().to(ratio.dtype)
    with torch.no_grad():
        metrics = {
            "clip_frac": _masked_mean(active, m, n),
            "clip_frac_high": _masked_mean(active_high, m, n),
            "clip_frac_low": _masked_mean(active & ~active_high, m, n),
            **_ratio_metrics(ratio, log_ratio, m, n),
        }
        # approx_kl stays a token-level estimate (not the sequence one) so it compares across losses.
        token_log_ratio = (logp - old).clamp(-EXP_CLAMP, EXP_CLAMP)
        metrics["approx_kl"] = _masked_mean(-token_log_ratio, m, n)
        metrics["approx_kl_k3"] = _masked_mean(torch.expm1(token_log_ratio) - token_log_ratio, m, n)
    return masked(loss, m), metrics


def cispo(
    logp: Tensor, old_logp: Tensor, advantages: Tensor, mask: Tensor, *, clip_low: float, clip_high: float
) -> tuple[Tensor, dict[str, Tensor]]:
    """Clipped IS-weight Policy Optimization (MiniMax-M1, 2025, arXiv:2506.13585).

    `loss = -sg(clip(r, 1 - clip_low, 1 + clip_high)) * A * logp` with `r = exp(clamp(logp - old, +-20))`.
    Unlike PPO, a clipped token still gets a gradient (`-w A`): the weight is capped, the token is not
    dropped, which keeps the learning signal of rare "fork" tokens. d loss / d logp = -w A everywhere.
    MiniMax uses no effective lower bound (pass `clip_low >= 1`) and a large `clip_high`.

    Args / Returns: as `ppo_clip` (without dual clip); `clip_frac` counts tokens whose weight was capped.
    """
    m, logp, old, adv = _prepare(logp, old_logp, advantages, mask, clip_low, clip_high)
    log_ratio = (logp - old).clamp(-EXP_CLAMP, EXP_CLAMP)
    ratio = torch.exp(log_ratio).detach()
    weight = ratio.clamp(1 - clip_low, 1 + clip_high)
    loss = -weight * adv * logp
    n = m.sum().to(ratio.dtype)
    with torch.no_grad():
        high = ratio > 1 + clip_high
        low = ratio < 1 - clip_low
        metrics = {
            "clip_frac": _masked_mean(high | low, m, n),
            "clip_frac_high": _masked_mean(high, m, n),
            "clip_frac_low": _masked_mean(low, m, n),
            **_ratio_metrics(ratio, log_ratio.detach(), m, n),
        }
    return masked(loss, m), metrics


def nll(logp: Tensor, mask: Tensor) -> tuple[Tensor, dict[str, Tensor]]:
    """Supervised fine-tuning's loss: the negative log-likelihood `-logp` of each target token, 0 at padding.

    Aggregated with `token-mean` over the whole global batch (`aggregate` with its global `num_tokens`) it is the
    mean cross-entropy over every loss token of the batch, as transformers' `labels` loss computes it for one
    batch in one piece (tokens labelled -100 left out), whatever the micro-batches, packing and ranks.
    """
    m = as_bool_mask(mask, logp)
    return masked(-as_float(logp), m), {}


def value_loss(
    values: Tensor, old_values: Tensor, returns: Tensor, mask: Tensor, *, clip: float | None = 0.2
) -> tuple[Tensor, dict[str, Tensor]]:
    """PPO's clipped value loss per token (Schulman et al. 2017, arXiv:1707.06347; verl `compute_value_loss`).

    `0.5 * max((v - R)^2, (old_v + clip(v - old_v, -clip, clip) - R)^2)`; `clip=None` gives the plain
    `0.5 * (v - R)^2`. The max keeps the update pessimistic: a value that moved more than `clip` from
    its rollout-time prediction gets no gradient when moving further helps the squared error.

    Args:
        values: [N, T] current critic predictions (gradient flows through these).
        old_values: [N, T] predictions at rollout time; returns: [N, T] targets (e.g. GAE returns).
        mask: [N, T] valid tokens; the loss is 0 at padding.
        clip: the clip range, or None.
    Returns:
        (per_token_loss [N, T], {"vf_clip_frac": fraction of valid tokens where the clipped branch is
        taken, "vf_error": mean |v - R|}).
    """
    if clip is not None and clip <= 0:
        raise ValueError(f"clip={clip!r} is not valid; it must be > 0 or None")
    m = as_bool_mask(mask, values)
    # Zero the padding first: garbage there must not reach the value nor (through 0 * NaN) the gradient.
    v, old, ret = (masked(as_float(x), m) for x in (values, old_values, returns))
    n = m.sum().to(v.dtype)
    unclipped = (v - ret).square()
    if clip is None:
        loss, taken = 0.5 * unclipped, torch.zeros_like(m)
    else:
        clipped = (old + (v - old).clamp(-clip, clip) - ret).square()
        loss, taken = 0.5 * torch.maximum(unclipped, clipped), clipped > unclipped
    with torch.no_grad():
        metrics = {"vf_clip_frac": _masked_mean(taken, m, n), "vf_error": _masked_mean((v - ret).abs(), m, n)}
    return masked(loss, m), metrics


def aggregate(
    per_token: Tensor,
    mask: Tensor,
    mode: str,
    *,
    norm_len: float | None = None,
    num_tokens: Tensor | float | None = None,
    num_seqs: Tensor | float | None = None,
) -> Tensor:
    """Reduce a per-token loss to a scalar.

    Modes (len_i = valid tokens of row i, S = sum over valid tokens):
    - `token-mean`: S / (valid tokens). Every token weighs the same (DAPO, Yu et al. 2025).
    - `seq-mean-token-sum`: sum_i (row sum) / (rows with >= 1 valid token).
    - `seq-mean-token-mean`: sum_i (row sum / len_i) / (rows with >= 1 valid token); the original GRPO
      (Shao et al. 2024), which weighs tokens of short answers more. Empty rows are left out.
    - `seq-mean-token-sum-norm`: S / (N * norm_len), Dr. GRPO (Liu et al. 2025): a constant denominator,
      so no length bias. `norm_len` defaults to T (the padded length of THIS tensor, which changes from
      micro-batch to micro-batch: pass the configured max response length instead).
    An empty mask gives 0, not NaN.

    Global normalisation (micro-batches and ranks): by default the denominators are the local ones above.
    A caller that splits a batch passes the GLOBAL denominators, and then the sum over all micro-batches
    (and ranks) of `aggregate(micro)` equals `aggregate(full batch)` exactly (to float rounding), so the
    summed gradients equal the full-batch gradient:
    - `num_tokens`: total valid tokens of the whole batch (used by `token-mean` only);
    - `num_seqs`: for `seq-mean-token-sum` / `seq-mean-token-mean` the number of rows with at least one
      valid token in the whole batch; for `seq-mean-token-sum-norm` the number of rows N of the whole
      batch (padding micro-batches excluded).
    A denominator a mode does not use is ignored, so a caller may always pass both. They may be Python
    numbers or 0-dim tensors (e.g. the result of an all-reduce); a zero denominator gives 0.

    Args:
        per_token: [N, T]; mask: [N, T] bool or 0/1; mode: one of `AGG_MODES`.
    Returns:
        0-dim tensor, float32 (float64 for float64 input), on the input's device.
    """
    check_choice("mode", mode, AGG_MODES)
    if norm_len is not None and not norm_len > 0:
        raise ValueError(f"norm_len={norm_len!r} is not valid; it must be a number > 0 (or None for T)")
    m = as_bool_mask(mask, per_token)
    x = masked(as_float(per_token), m)
    dtype, device = x.dtype, x.device

    def given(value):
        return torch.as_tensor(value, device=device).to(dtype)

    if mode == "token-mean":
        den = m.sum().to(dtype) if num_tokens is None else given(num_tokens)
        return safe_div(x.sum(), den)
    if mode == "seq-mean-token-sum-norm":
        rows = x.shape[0] if num_seqs is None else num_seqs
        length = x.shape[-1] if norm_len is None else norm_len
        return safe_div(x.sum(), given(rows) * length)
    lengths = m.sum(dim=-1).to(dtype)
    row_values = x.sum(dim=-1)
    if mode == "seq-mean-token-mean":
        row_values = safe_div(row_values, lengths)
    den = (lengths > 0).sum().to(dtype) if num_seqs is None else given(num_seqs)
    return safe_div(row_values.sum(), den)


# -- the registry of policy losses (algo.policy_loss) ------------------------------------------------------
# Each entry is called as fn(logp, old_logp, advantages, mask, params) with `params` the algo config
# (clip_low, clip_high, dual_clip, ...) and returns (per_token_loss [N, T], metrics).
PolicyLossFn = Callable[[Tensor, Tensor, Tensor, Tensor, Any], tuple[Tensor, dict[str, Tensor]]]
POLICY_LOSSES: Registry[PolicyLossFn] = Registry("algo.policy_loss")


@POLICY_LOSSES.register("ppo_clip")
def _ppo_clip(logp, old_logp, advantages, mask, params):
    return ppo_clip(
        logp, old_logp, advantages, mask, clip_low=params.clip_low, clip_high=params.clip_high,
        dual_clip=params.dual_clip,
    )  # fmt: skip


@POLICY_LOSSES.register("gspo")
def _gspo(logp, old_logp, advantages, mask, params):
    return gspo(logp, old_logp, advantages, mask, clip_low=params.clip_low, clip_high=params.clip_high)


@POLICY_LOSSES.register("cispo")
def _cispo(logp, old_logp, advantages, mask, params):
    return cispo(logp, old_logp, advantages, mask, clip_low=params.clip_low, clip_high=params.clip_high)


@POLICY_LOSSES.register("nll")
def _nll(logp, old_logp, advantages, mask, params):
    # Supervised fine-tuning (python -m rlkit.sft): no ratio, no advantage; the batch's tokens are the targets.
    return nll(logp, mask)


def policy_loss(name: str, logp, old_logp, advantages, mask, params) -> tuple[Tensor, dict[str, Tensor]]:
    """The registered policy loss `name` (see `POLICY_LOSSES`)."""
    return POLICY_LOSSES.get_checked(name)(logp, old_logp, advantages, mask, params)
