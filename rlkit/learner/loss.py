"""The loss of one micro-batch, assembled from rlkit.algos with the global denominators of its mini-batch.

    loss =            agg(policy_loss(logp, old_logp, A) * is_weights)   algo.policy_loss, clip_low, clip_high, dual_clip
         + kl_coef  * agg(kl_estimate(logp, ref_logp, kl_estimator))      algo.kl_coef, kl_estimator (needs ref_logprobs)
         + rollout_kl_coef * agg(rollout_kl(logp, rollout_logp))          algo.rollout_kl_coef, rollout_kl_estimator
         + vf_coef  * agg(value_loss(v, old_v, returns))                  algo.value_model, vf_coef, value_clip
         - entropy_coef * agg(entropy)                                    algo.entropy_coef

Every term is aggregated with `algo.loss_agg_mode` over the WHOLE global mini-batch: each micro-batch
divides its own sum by the global count (never its own), so summing the micro-batch losses over all
micro-batches and ranks gives the loss of the whole mini-batch, and so does the accumulated gradient.
`old_logp` is the batch's `old_logprobs` when the update is off-policy, else `logp.detach()` (ratio 1).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from rlkit.algos import correction, kl, losses
from rlkit.learner.batching import MiniBatch


def micro_loss(
    algo,
    kl_coef: float,
    tok: Callable[[str], Tensor | None],
    mask: Tensor,
    mb: MiniBatch,
    logp: Tensor,
    entropy: Tensor,
    values: Tensor | None,
) -> tuple[Tensor, dict[str, Tensor], Tensor]:
    """(loss, metrics, token weight) of one micro-batch; the loss is its share of the global loss.

    `algo` is the algo config, `kl_coef` the KL loss coefficient (0 when the KL goes into the reward),
    `tok(name)` a per-token field of the micro-batch trimmed to its width, `mask` its bool loss mask,
    `logp` / `entropy` the policy's scores and `values` the critic's (or None).
    """
    agg_kw = {"norm_len": mb.norm_len, "num_tokens": mb.num_tokens, "num_seqs": mb.num_seqs}

    def agg(per_token: Tensor) -> Tensor:
        return losses.aggregate(per_token, mask, algo.loss_agg_mode, **agg_kw)

    ntok = mask.sum()

    def token_mean(x: Tensor) -> Tensor:
        return torch.where(mask, x.detach().float(), 0.0).sum() / ntok.clamp(min=1)

    old = tok("old_logprobs")
    old = logp.detach() if old is None else old
    pg, pg_metrics = losses.policy_loss(algo.policy_loss, logp, old, tok("advantages"), mask, algo)
    metrics = {f"policy/{k}": v for k, v in pg_metrics.items()}
    is_weights = tok("is_weights")
    parts = {"policy": agg(pg if is_weights is None else pg * is_weights)}
    if kl_coef > 0:
        k = kl.kl_estimate(logp, tok("ref_logprobs"), algo.kl_estimator)
        parts["kl"] = kl_coef * agg(k)
        metrics["kl_ref"] = token_mean(k)
    if algo.rollout_kl_coef > 0:
        rk = correction.rollout_kl(logp, tok("rollout_logprobs"), kind=algo.rollout_kl_estimator)
        parts["rollout_kl"] = algo.rollout_kl_coef * agg(rk)
        metrics["rollout_kl"] = token_mean(rk)
    if algo.entropy_coef > 0:
        parts["entropy"] = -algo.entropy_coef * agg(entropy)
    metrics["entropy"] = token_mean(entropy)
    if values is not None:
        vl, vf_metrics = losses.value_loss(values, tok("values"), tok("returns"), mask, clip=algo.value_clip)
        parts["value"] = algo.vf_coef * agg(vl)
        metrics.update({f"value/{k}": x for k, x in vf_metrics.items()})
        metrics["value/pred_mean"] = token_mean(values)
    loss = sum(parts.values())

    # Loss parts are shares of a global sum, but the merger takes token-weighted means: report each
    # part scaled by (global tokens / local tokens) so the merged value is the whole mini-batch's loss.
    scale = (mb.num_tokens / ntok.clamp(min=1)).float()
    for name, part in parts.items():
        metrics[f"loss/{name}"] = part.detach() * scale
    metrics["loss/total"] = loss.detach() * scale
    return loss, metrics, ntok
