"""Rollout correction: the rollout engine (vLLM, or HF generate) and the learner compute slightly different
log-probs for the same tokens (kernels, precision, sampling tricks), so the rollout is off-policy for the
learner. These functions measure the mismatch and reweight or reject tokens.

References: Yao et al. 2025, "Your Efficient RL Framework Secretly Brings You Off-Policy RL Training"
(https://fengyao.notion.site/off-policy-rl): truncated importance sampling (TIS) and masked importance
sampling (MIS); verl's rollout correction (`rollout_corr_helper.py`, `mismatch_helper.py`) for the
token / sequence / geometric levels, the veto and the metric names.

Shapes: N samples, T response tokens; `mask` bool or 0/1. `train_logp` are the learner's log-probs of the
sampled tokens (before the update), `rollout_logp` the engine's.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from rlkit.algos.common import EXP_CLAMP, as_bool_mask, as_float, check_choice, masked, safe_div
from rlkit.algos.kl import kl_estimate

__all__ = [
    "LEVELS",
    "MODES",
    "IS_METRIC_KEYS",
    "MISMATCH_METRIC_KEYS",
    "rollout_is",
    "mismatch_metrics",
    "rollout_kl",
]

LEVELS = ("token", "sequence", "geometric")
MODES = ("truncate", "mask", "both")
IS_METRIC_KEYS = tuple(
    "rollout_is/" + k
    for k in (
        "mean",
        "max",
        "min",
        "std",
        "eff_sample_size",
        "fraction_high",
        "fraction_low",
        "masked_fraction",
        "seq_masked_fraction",
        "veto_fraction",
        "catastrophic_token_fraction",
    )
)
MISMATCH_METRIC_KEYS = tuple(
    "mismatch/" + k
    for k in (
        "kl",
        "k3_kl",
        "training_ppl",
        "rollout_ppl",
        "log_ppl_diff",
        "log_ppl_abs_diff",
        "ppl_ratio",
        "logprob_abs_diff",
    )
)


def _log_ratio(train_logp: Tensor, rollout_logp: Tensor, m: Tensor) -> Tensor:
    if rollout_logp.shape != train_logp.shape:
        raise ValueError(
            f"rollout_logp has shape {tuple(rollout_logp.shape)}, expected {tuple(train_logp.shape)}"
        )
    dtype = torch.promote_types(as_float(train_logp).dtype, as_float(rollout_logp).dtype)
    return masked(train_logp.detach().to(dtype) - rollout_logp.detach().to(dtype), m)


def _positive(name: str, value) -> None:
    if value is not None and not value > 0:
        raise ValueError(f"{name}={value!r} is not valid; it must be a number > 0 (or None)")


def rollout_is(
    train_logp: Tensor,
    rollout_logp: Tensor,
    mask: Tensor,
    *,
    level: str = "token",
    mode: str = "truncate",
    upper: float = 2.0,
    lower: float | None = None,
    veto_lower: float | None = None,
    veto_upper: float | None = None,
) -> tuple[Tensor, Tensor, dict[str, Tensor]]:
    """Importance weights `pi_train / pi_rollout` that correct the loss for the rollout mismatch.

    `level` sets what one weight covers (log-ratios clamped to +-20 before exp):
    - `token`: each token's own ratio (per-token TIS/MIS; low variance, biased).
    - `sequence`: exp of the row's summed log-ratio (the unbiased sequence IS; variance grows with length).
    - `geometric`: exp of the row's mean log-ratio (length-normalised; mostly used to reject rows).
    `mode` sets what happens to a weight outside `[lower, upper]` (`lower` defaults to `1 / upper`):
    - `truncate` (TIS): weights are capped at `upper`; nothing leaves the mask.
    - `mask` (MIS / rejection sampling): tokens (level token) or whole rows (sequence, geometric) outside
      `[lower, upper]` leave the mask; kept weights are unchanged.
    - `both`: weights capped at `upper` and the same rejection mask. With the same bounds the kept weights
      are already <= upper, so the values equal `mask`'s; the cap documents the intent and guards
      against rounding.
    Veto: a row is dropped from the mask when any valid token's raw ratio is below `veto_lower` or above
    `veto_upper` (whatever the level), e.g. a token the learner considers impossible.

    Metrics (keys `IS_METRIC_KEYS`), measured on the raw weights before truncation and rejection, over the
    valid tokens of `mask` (a row weight counts once per token, so they merge by token count):
    `rollout_is/mean`, `/max`, `/min`; `/std` and `/eff_sample_size` (E[w]^2 / E[w^2], a fraction in
    (0, 1]) of the weights clamped to [lower, upper]; `/fraction_high` and `/fraction_low` (weights above
    upper / below lower); `/masked_fraction` (valid tokens removed from the mask by the rejection or the
    veto); `/seq_masked_fraction` (non-empty rows that lost at least one token); `/veto_fraction`
    (non-empty rows vetoed); `/catastrophic_token_fraction` (valid tokens outside the veto bounds).

    Args:
        train_logp: [N, T]; rollout_logp: [N, T]; mask: [N, T] bool or 0/1.
    Returns:
        (weights [N, T] detached, 0 wherever the returned mask is False;
         mask [N, T] bool, the input mask minus rejected tokens and vetoed rows;
         metrics: dict of 0-dim tensors).
    """
    check_choice("level", level, LEVELS)
    check_choice("mode", mode, MODES)
    _positive("upper", upper)
    _positive("lower", lower)
    _positive("veto_lower", veto_lower)
    _positive("veto_upper", veto_upper)
    lower = 1.0 / upper if lower is None else lower
    if not upper > lower:
        raise ValueError(f"upper={upper!r} must be > lower={lower!r} (lower defaults to 1/upper)")
    if veto_lower is not None and veto_upper is not None and not veto_upper > veto_lower:
        raise ValueError(f"veto_upper={veto_upper!r} must be > veto_lower={veto_lower!r}")

    m = as_bool_mask(mask, train_logp)
    token_lr = _log_ratio(train_logp, rollout_logp, m)
    dtype = token_lr.dtype
    lengths = m.sum(dim=1, keepdim=True)
    if level == "token":
        lr = token_lr
    else:
        lr = token_lr.sum(dim=1, keepdim=True)
        if level == "geometric":
            lr = safe_div(lr, lengths.to(dtype))
        lr = lr.expand_as(token_lr)
    raw = torch.exp(lr.clamp(-EXP_CLAMP, EXP_CLAMP))

    outside = (raw > upper) | (raw < lower)
    keep = m if mode == "truncate" else m & ~outside

    catastrophic = torch.zeros_like(m)
    if veto_lower is not None:
        catastrophic = catastrophic | (token_lr < math.log(veto_lower))
    if veto_upper is not None:
        catastrophic = catastrophic | (token_lr > math.log(veto_upper))
    catastrophic = catastrophic & m
    vetoed_row = catastrophic.any(dim=1, keepdim=True)
    keep = keep & ~vetoed_row

    weights = raw if mode == "mask" else raw.clamp(max=upper)
    weights = masked(weights, keep)

    n_tok = m.sum().to(dtype)
    nonempty = lengths.squeeze(1) > 0
    n_rows = nonempty.sum().to(dtype)

    def tok_mean(x):
        return safe_div(masked(x.to(dtype), m).sum(), n_tok)

    def row_mean(x):
        return safe_div((x & nonempty).sum().to(dtype), n_rows)

    def extreme(x, largest):
        fill = torch.full((1,), float("-inf") if largest else float("inf"), dtype=dtype, device=x.device)
        v = torch.cat([torch.where(m, x, fill).flatten(), fill])  # fill keeps a zero-row batch defined
        v = v.amax() if largest else v.amin()
        return torch.where(n_tok > 0, v, torch.zeros_like(v))

    clamped = raw.clamp(lower, upper)
    mean_c, mean_sq_c = tok_mean(clamped), tok_mean(clamped.square())
    metrics = {
        "rollout_is/mean": tok_mean(raw),
        "rollout_is/max": extreme(raw, True),
        "rollout_is/min": extreme(raw, False),
        "rollout_is/std": (mean_sq_c - mean_c.square()).clamp(min=0).sqrt(),
        "rollout_is/eff_sample_size": safe_div(mean_c.square(), mean_sq_c),
        "rollout_is/fraction_high": tok_mean(raw > upper),
        "rollout_is/fraction_low": tok_mean(raw < lower),
        "rollout_is/masked_fraction": tok_mean(m & ~keep),
        "rollout_is/seq_masked_fraction": row_mean((m & ~keep).any(dim=1)),
        "rollout_is/veto_fraction": row_mean(vetoed_row.squeeze(1)),
        "rollout_is/catastrophic_token_fraction": tok_mean(catastrophic),
    }
    return weights, keep, metrics


def mismatch_metrics(train_logp: Tensor, rollout_logp: Tensor, mask: Tensor) -> dict[str, Tensor]:
    """How far the learner's log-probs are from the engine's (keys `MISMATCH_METRIC_KEYS`).

    Token means over valid tokens: `mismatch/kl` = mean(rollout - train), the k1 estimate of
    KL(rollout || train) (can be < 0; ~0 right after a correct weight push); `mismatch/k3_kl` =
    mean(exp(lr) - lr - 1) with lr = train - rollout (non-negative); `mismatch/logprob_abs_diff` =
    mean |train - rollout|. Sequence means over rows with at least one valid token (empty rows are left
    out): `mismatch/training_ppl` and `mismatch/rollout_ppl` = mean_i exp(-row mean logp);
    `mismatch/log_ppl_diff` = mean_i (row mean rollout - row mean train) (= log training ppl - log
    rollout ppl), `mismatch/log_ppl_abs_diff` its absolute value, `mismatch/ppl_ratio` =
    mean_i (training ppl / rollout ppl). Follows verl's `compute_mismatch_metrics`.

    Args:
        train_logp, rollout_logp, mask: [N, T].
    Returns:
        dict of detached 0-dim tensors (0 for an empty mask).
    """
    m = as_bool_mask(mask, train_logp)
    lr = _log_ratio(train_logp, rollout_logp, m)
    dtype = lr.dtype
    train = masked(train_logp.detach().to(dtype), m)
    rollout = masked(rollout_logp.detach().to(dtype), m)
    n_tok = m.sum().to(dtype)
    lengths = m.sum(dim=1).to(dtype)
    nonempty = lengths > 0
    n_rows = nonempty.sum().to(dtype)

    def tok_mean(x):
        return safe_div(masked(x, m).sum(), n_tok)

    def row_mean(x):
        return safe_div(masked(x, nonempty).sum(), n_rows)

    train_row = safe_div(train.sum(dim=1), lengths)
    rollout_row = safe_div(rollout.sum(dim=1), lengths)
    row_diff = rollout_row - train_row
    clamped = lr.clamp(-EXP_CLAMP, EXP_CLAMP)
    return {
        "mismatch/kl": tok_mean(-lr),
        "mismatch/k3_kl": tok_mean(torch.expm1(clamped) - clamped),
        "mismatch/training_ppl": row_mean(torch.exp(-train_row)),
        "mismatch/rollout_ppl": row_mean(torch.exp(-rollout_row)),
        "mismatch/log_ppl_diff": row_mean(row_diff),
        "mismatch/log_ppl_abs_diff": row_mean(row_diff.abs()),
        "mismatch/ppl_ratio": row_mean(torch.exp(row_diff)),
        "mismatch/logprob_abs_diff": tok_mean(lr.abs()),
    }


def rollout_kl(logp: Tensor, rollout_logp: Tensor, *, kind: str = "k2") -> Tensor:
    """Per-token KL between the current policy and the rollout engine's distribution, as a loss term: a
    soft trust region that keeps training from drifting far from what the engine sampled (in the spirit
    of the rollout-correction work of Yao et al. 2025). The gradient flows through `logp` only.
    `k2` (default) has the gradient of the true KL for on-policy samples; see `rlkit.algos.kl`.

    Args:
        logp: [N, T] with grad; rollout_logp: [N, T]; kind: `k1`, `abs`, `k2` or `k3`.
    Returns:
        [N, T]; padding holds whatever the inputs give: aggregate it with a mask.
    """
    return kl_estimate(logp, rollout_logp.detach(), kind)
