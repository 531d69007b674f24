"""The loss of one micro-batch, assembled from rlkit.algos with the global denominators of its mini-batch.

    loss =            agg(policy_loss(logp, old_logp, A) * is_weights)   algo.policy_loss, clip_low, clip_high, dual_clip
         + kl_coef  * agg(kl_estimate(logp, ref_logp, kl_estimator))      algo.kl_coef (0 with kl_in_reward), kl_estimator
         + rollout_kl_coef * agg(rollout_kl(logp, rollout_logp))          algo.rollout_kl_coef, rollout_kl_estimator
         + vf_coef  * agg(value_loss(v, old_v, returns))                  algo.value_model, vf_coef, value_clip
         - entropy_coef * agg(entropy)                                    algo.entropy_coef

Every term is aggregated with `algo.loss_agg_mode` over the WHOLE global mini-batch: each micro-batch
divides its own sum by the global count (never its own), so summing the micro-batch losses over all
micro-batches and ranks gives the loss of the whole mini-batch, and so does the accumulated gradient.
`old_logp` is the batch's `old_logprobs` when the update is off-policy, else `logp.detach()`: with the default
one optimizer step per batch the ratio is exactly 1, so `ppo_clip` is REINFORCE with the estimator's baseline
(the clip acts only with several steps per batch: algo.ppo_epochs / mini_batches; rollout IS weights still apply).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from rlkit.algos import correction, kl, losses
from rlkit.learner.batching import MiniBatch


@dataclass(frozen=True)
class MicroInputs:
    """One micro-batch's per-token inputs to the loss, each [n, t] (its rows, trimmed to its response width)."""

    logprobs: Tensor
    """The policy's log-probs of the sampled tokens, with grad."""
    entropy: Tensor
    """The policy's entropy at each token (with grad when algo.entropy_coef > 0)."""
    mask: Tensor
    """bool: the tokens that train (the TrainBatch's response_mask)."""
    advantages: Tensor
    old_logprobs: Tensor | None = None
    """The behaviour policy's log-probs (an off-policy update), else None: the ratio is 1."""
    ref_logprobs: Tensor | None = None
    """The reference's log-probs (the KL loss term), else None."""
    rollout_logprobs: Tensor | None = None
    """The engine's log-probs (the rollout-KL term), else None."""
    is_weights: Tensor | None = None
    """Rollout IS weights (detached), else None."""
    values: Tensor | None = None
    """The critic's values now, with grad (algo.value_model), else None."""
    old_values: Tensor | None = None
    """The critic's values when the batch was scored (value clipping)."""
    returns: Tensor | None = None
    """The value targets."""


def micro_loss(
    algo, kl_loss_coef: float, x: MicroInputs, mb: MiniBatch
) -> tuple[Tensor, dict[str, Tensor], Tensor]:
    """(loss, metrics, token weight) of one micro-batch; the loss is its share of the global loss.

    `algo` is the algo config, `kl_loss_coef` the KL loss coefficient (rlkit.config.derived: 0 when the KL
    goes into the reward), `mb` the mini-batch whose global denominators every term divides by.
    """
    agg_kw = {"norm_len": mb.norm_len, "num_tokens": mb.num_tokens, "num_seqs": mb.num_seqs}

    def agg(per_token: Tensor) -> Tensor:
        return losses.aggregate(per_token, x.mask, algo.loss_agg_mode, **agg_kw)

    mask, logp, entropy, values = x.mask, x.logprobs, x.entropy, x.values
    ntok = mask.sum()

    def token_mean(v: Tensor) -> Tensor:
        return torch.where(mask, v.detach().float(), 0.0).sum() / ntok.clamp(min=1)

    # With one optimizer step per batch the update is on-policy: the ratio is exactly 1 (the clip never acts).
    old = logp.detach() if x.old_logprobs is None else x.old_logprobs
    pg, pg_metrics = losses.policy_loss(algo.policy_loss, logp, old, x.advantages, mask, algo)
    metrics = {f"policy/{k}": v for k, v in pg_metrics.items()}
    parts = {"policy": agg(pg if x.is_weights is None else pg * x.is_weights)}
    if kl_loss_coef > 0:
        k = kl.kl_estimate(logp, x.ref_logprobs, algo.kl_estimator)
        parts["kl"] = kl_loss_coef * agg(k)
        metrics["kl_ref"] = token_mean(k)
    if algo.rollout_kl_coef > 0:
        rk = correction.rollout_kl(logp, x.rollout_logprobs, kind=algo.rollout_kl_estimator)
        parts["rollout_kl"] = algo.rollout_kl_coef * agg(rk)
        metrics["rollout_kl"] = token_mean(rk)
    if algo.entropy_coef > 0:
        parts["entropy"] = -algo.entropy_coef * agg(entropy)
    metrics["entropy"] = token_mean(entropy)
    if values is not None:
        vl, vf_metrics = losses.value_loss(values, x.old_values, x.returns, mask, clip=algo.value_clip)
        parts["value"] = algo.vf_coef * agg(vl)
        metrics.update({f"value/{k}": v for k, v in vf_metrics.items()})
        metrics["value/pred_mean"] = token_mean(values)
    loss = sum(parts.values())

    # Loss parts are shares of a global sum, but the merger takes token-weighted means: report each
    # part scaled by (global tokens / local tokens) so the merged value is the whole mini-batch's loss.
    scale = (mb.num_tokens / ntok.clamp(min=1)).float()
    for name, part in parts.items():
        metrics[f"loss/{name}"] = part.detach() * scale
    metrics["loss/total"] = loss.detach() * scale
    return loss, metrics, ntok
