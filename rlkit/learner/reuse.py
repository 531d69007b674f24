"""The update's own forward as the scoring pass: on-policy log-probs, entropy and rollout IS weights.

When a batch is used for exactly one optimizer step (one epoch, one mini-batch) and nothing else needs a
forward pass of its own (no reference KL, no critic, no teacher), the policy that scores the batch is the
one the update's first forward runs, before any weight changes. `ForwardScores` collects that forward's
log-probs and entropy (detached) micro-batch by micro-batch, so the trainer's separate scoring pass
(phase 3) is not needed: one forward less per step, the same numbers.

The rollout IS weights fit inside a micro-batch, since every level is per row: `token` is each token's own
ratio; `sequence` and `geometric` are the exp of the row's summed / mean log-ratio over the row's own tokens,
and every row of a micro-batch is whole; the veto looks at one row's tokens. So `take` computes each
micro-batch's weights from its rows alone, equal to those of the whole batch. What does NOT fit is anything
that changes the loss's global denominators: IS rejection (`mode` mask / both) and the veto remove tokens
from the loss mask, and the mini-batch's token and row counts that every micro-batch divides by are summed
over all ranks before the first forward; so those settings keep the separate pass (`reusable`). The IS and
mismatch metrics are computed by the trainer afterwards over the whole batch from the collected log-probs,
exactly as before (no micro-batch means of batch-wide statistics such as `rollout_is/eff_sample_size`).

Rows the update never runs (no loss token: zero-std groups, responses cut by the length cap) still count in
the metrics: `Learner.update` scores them in one no-grad forward before its first optimizer step.
"""

from __future__ import annotations

import torch
from torch import Tensor

from rlkit.algos import correction
from rlkit.config.derived import derive


def has_dropout(model: torch.nn.Module) -> bool:
    """True when training mode changes the forward (an active dropout module, or a config's dropout rate)."""
    if any(isinstance(m, torch.nn.Dropout) and m.p > 0 for m in model.modules()):
        return True
    cfg = getattr(model, "config", None)
    rates = [v for k, v in (vars(cfg).items() if cfg is not None else ()) if k.endswith(("dropout", "pdrop"))]
    return any(isinstance(v, (int, float)) and v > 0 for v in rates)


def reusable(cfg, *, dropout: bool) -> tuple[bool, str]:
    """(whether the update's forward can replace the scoring pass, why not). `dropout`: the policy's forward
    differs between training and evaluation mode (then the update's log-probs are not the scoring pass's)."""
    a, c, d = cfg.algo, cfg.algo.rollout_is, derive(cfg)
    reasons = [
        (not cfg.trainer.reuse_update_forward, "trainer.reuse_update_forward=false"),
        (d.off_policy, "more than one optimizer step per batch (off-policy)"),
        (d.needs_reference, "a reference model (algo.kl_coef > 0)"),
        (a.value_model, "a critic (algo.value_model)"),
        (d.has_teacher, "a distillation teacher"),
        (bool(c.enabled) and c.mode != "truncate", f"IS rejection (algo.rollout_is.mode={c.mode})"),
        (bool(c.enabled) and (c.veto_lower is not None or c.veto_upper is not None), "the IS veto"),
        (dropout, "dropout in the policy"),
        (a.max_token_staleness is not None, "algo.max_token_staleness (it masks single tokens of a row)"),
    ]
    why = [r for bad, r in reasons if bad]
    return not why, "; ".join(why)


class ForwardScores:
    """The pre-update log-probs and entropy [N, T] float32 of the tokens of `mask`, filled by `Learner.update`.

    `mask` [N, T] bool: the tokens wanted (with IS weights: every sampled token of each row). Every row with
    a loss token must hold exactly that row of `mask` as its loss mask, or no token (the trainer's loss mask
    only removes whole rows: zero-std groups, overlong responses). With `is_cfg` (algo.rollout_is, mode
    truncate, no veto) and `rollout_logprobs` [N, T], `take` returns each micro-batch's IS weights.
    """

    def __init__(self, mask: Tensor, *, rollout_logprobs: Tensor | None = None, is_cfg=None):
        if is_cfg is not None and rollout_logprobs is None:
            raise ValueError("ForwardScores with is_cfg needs rollout_logprobs")
        self.mask = mask.bool()
        self.rollout_logprobs = rollout_logprobs
        self.is_cfg = is_cfg
        self.logprobs = torch.zeros(mask.shape, device=mask.device)
        self.entropy = torch.zeros(mask.shape, device=mask.device)

    def untrained_rows(self, loss_mask: Tensor) -> Tensor:
        """[N] bool: rows holding wanted tokens but no loss token (the update never runs them)."""
        return self.mask.any(-1) & ~loss_mask.bool().any(-1)

    def put(self, rows: Tensor, logprobs: Tensor, entropy: Tensor) -> None:
        """Store full-width [N, T] scores of `rows` (the no-grad forward of the untrained rows)."""
        keep = self.mask & rows[:, None]
        self.logprobs = torch.where(keep, logprobs.float(), self.logprobs)
        self.entropy = torch.where(keep, entropy.float(), self.entropy)

    def take(self, rows: Tensor | None, logp: Tensor, entropy: Tensor) -> Tensor | None:
        """Keep one micro-batch's scores (`rows` of the batch, None for a padding micro-batch, [n, t] values
        with grad) detached; return its IS weights [n, t] (None without IS or for a padding micro-batch)."""
        if rows is None:
            return None
        t = logp.shape[1]
        keep = self.mask[rows, :t]
        lp = logp.detach().float()
        self.logprobs[rows, :t] = torch.where(keep, lp, 0.0)
        self.entropy[rows, :t] = torch.where(keep, entropy.detach().float(), 0.0)
        if self.is_cfg is None:
            return None
        c = self.is_cfg
        weights, _, _ = correction.rollout_is(
            lp, self.rollout_logprobs[rows, :t].float(), keep, level=c.level, mode=c.mode, upper=c.upper,
            lower=c.lower, veto_lower=c.veto_lower, veto_upper=c.veto_upper,
        )  # fmt: skip
        return weights
