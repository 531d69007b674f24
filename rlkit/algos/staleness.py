"""Per-token staleness: how many policy versions lie between the weights that sampled each token and the
policy being trained (asynchronous training; with in-flight weight updates one row can hold tokens of several
versions, rlkit.batch.RolloutBatch.token_versions).

The behaviour log-prob of every token is the one its own sampler computed (`rollout_logprobs`), so rollout IS
and decoupled PPO (rlkit.algos.correction.rollout_is) correct each token against the policy that sampled it
with no change; these functions only measure the staleness and, optionally, drop tokens that are too old.
Pure tensor functions: nothing is written to an argument.
"""

from __future__ import annotations

import torch
from torch import Tensor


def token_staleness(token_versions: Tensor, mask: Tensor, current: int) -> Tensor:
    """[N, T] long: `current - version` on the tokens of `mask`, 0 elsewhere (padding, environment tokens)."""
    return torch.where(mask.bool(), current - token_versions, torch.zeros_like(token_versions))


def fresh_tokens(
    token_versions: Tensor, mask: Tensor, current: int, max_token_staleness: int | None
) -> Tensor:
    """[N, T] bool: `mask` without the tokens sampled more than `max_token_staleness` versions before
    `current` (`algo.max_token_staleness`; None keeps every token)."""
    mask = mask.bool()
    if max_token_staleness is None:
        return mask.clone()
    return mask & (current - token_versions <= max_token_staleness)


def staleness_metrics(token_versions: Tensor, mask: Tensor, current: int) -> tuple[dict, dict]:
    """(token metrics, row metrics). Token metrics, means over the tokens of `mask`: `staleness/token_mean`,
    `staleness/token_max`. Row metrics, means over the rows: `inflight/mixed_rows`, the fraction of rows
    whose tokens were sampled by more than one policy version (rows without a token count as not mixed)."""
    mask = mask.bool()
    lag = token_staleness(token_versions, mask, current).double()
    tokens = mask.sum()
    mean = lag.sum() / tokens.clamp(min=1)
    top = lag.amax() if lag.numel() else lag.new_zeros(())  # 0 off the mask; a version is never ahead
    big = torch.iinfo(token_versions.dtype).max
    newest = torch.where(mask, token_versions, torch.full_like(token_versions, -big)).amax(-1)
    oldest = torch.where(mask, token_versions, torch.full_like(token_versions, big)).amin(-1)
    mixed = (mask.any(-1) & (newest != oldest)).double()
    return (
        {"staleness/token_mean": mean, "staleness/token_max": top},
        {"inflight/mixed_rows": mixed.mean() if mixed.numel() else mixed.new_zeros(())},
    )
