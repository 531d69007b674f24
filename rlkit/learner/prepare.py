"""Phases 3-5 of a step: from a scored rollout batch to the `TrainBatch` the update trains.

    3 logprobs     `score`: the current policy's log-probs (and the reference's, the critic's values)
    4 advantages   `advantages`: the registered estimator (rlkit.algos.advantages), the distillation term
                   (rlkit.algos.distill), the loss mask without zero-std groups and length-cut responses
    5 correction   `correction`: mismatch metrics and rollout IS weights (rlkit.algos.correction);
                   `token_staleness`: per-token staleness metrics and mask (rlkit.algos.staleness)
    then           `train_batch`: the TrainBatch for `Learner.update`

The trainer (rlkit/trainer.py) runs each inside its timer; every token statistic goes into the step's
`MetricMerger`, weighted by its token count.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from rlkit.algos import advantages as adv
from rlkit.algos import correction, distill, kl, staleness
from rlkit.batch import RolloutBatch, ScoredBatch, Sequences, TrainBatch
from rlkit.collectives import all_reduce
from rlkit.learner.learner import Learner, LogProbs
from rlkit.metrics import MetricMerger


def masked_mean(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    m = mask.to(x.dtype)
    return (x * m).sum() / m.sum().clamp_min(1)


@dataclass
class Scored:
    """Phase 3's output: the current policy's view of a batch."""

    logp: torch.Tensor | None
    """[scored, T] current-policy log-probs of the first `scored` rows (all rows when the update needs them)."""
    probe: torch.Tensor
    """[scored, T] bool, the tokens whose log-probs were computed."""
    lp: object
    kl_tok: torch.Tensor | None
    """[N, T] per-token KL to the reference (when there is one)."""


class Preparer:
    """Phases 3-5 for one rank's share of the batch, with the learner that scores it."""

    def __init__(self, cfg, learner: Learner, *, world: int):
        self.cfg, self.learner, self.world = cfg, learner, world
        self.device = learner.device
        self.group_size = cfg.rollout.group_size
        self.distill = learner.teacher is not None

    def scored_rows(self, n: int, *, whole: bool) -> int:
        """How many of the batch's first rows phase 3 scores: all `n` when the update needs every row's
        log-probs (`whole`), else `rollout.mismatch_samples` of them (0 = all)."""
        if not whole and self.cfg.rollout.mismatch_samples > 0:
            return min(self.cfg.rollout.mismatch_samples, n)
        return n

    def score(self, rb: RolloutBatch, mask, token_metrics: MetricMerger) -> Scored:
        """3. log-probs. The whole batch needs the current policy's log-probs when the update uses them (IS
        weights, the off-policy ratio's denominator, the KL to the reference, the critic's baseline);
        otherwise the update's own forward pass serves, and only `rollout.mismatch_samples` samples are
        scored here for the mismatch metrics that prove the weight push happened."""
        a = self.cfg.algo
        need_ref = a.kl_coef > 0
        whole = a.rollout_is.enabled or self.learner.off_policy or need_ref or a.value_model or self.distill
        scored = self.scored_rows(rb.num_samples, whole=whole)
        seqs = Sequences.of(rb).select(slice(0, scored))  # all rows when scored == N (a view)
        lp = self.learner.forward(seqs, policy=True, ref=need_ref, values=a.value_model)
        logp = lp.logprobs.to(self.device)
        probe = mask[:scored]
        kl_tok = None
        if need_ref:
            # The KL to the reference as the rollout saw it, measured before any advantage code runs.
            kl_tok = kl.kl_estimate(logp, lp.ref_logprobs.to(self.device), a.kl_estimator)
            token_metrics.add({"rollout/kl": masked_mean(kl_tok, mask)}, mask.sum())
        token_metrics.add({"rollout/entropy": masked_mean(lp.entropy.to(self.device), probe)}, probe.sum())
        return Scored(logp, probe, lp, kl_tok)

    def scored_by_update(self, scores, probe, scored: int, token_metrics: MetricMerger) -> Scored:
        """Phase 3's view when the update's first forward scored the batch (rlkit/learner/reuse.py): the
        log-probs and entropy it collected for the first `scored` rows, with the entropy metric `score` logs."""
        lp = LogProbs(logprobs=scores.logprobs[:scored], entropy=scores.entropy[:scored])
        view = Scored(lp.logprobs, probe[:scored], lp, None)
        token_metrics.add({"rollout/entropy": masked_mean(lp.entropy, view.probe)}, view.probe.sum())
        return view

    def teacher_logprobs(self, rb: RolloutBatch) -> torch.Tensor:
        """The distillation teacher's log-probs of the sampled tokens."""
        return self.learner.forward(rb, policy=False, teacher=True).teacher_logprobs.to(self.device)

    def advantages(
        self, produced: ScoredBatch, mask, scored: Scored, teacher_logp, token_metrics: MetricMerger
    ):
        """4. advantages from the registered estimator, plus the distillation term when there is a teacher
        (rlkit/algos/distill.py); the loss mask without zero-std groups (not with distillation: its term is
        informative in every group) and, with `algo.overlong_filter`, without responses cut by the length cap.
        Returns (advantages, returns, zero_std, loss_mask)."""
        a, rb = self.cfg.algo, produced.rollout
        rewards = produced.rewards.to(self.device)
        inputs = adv.AdvantageInputs(
            rewards=rewards, mask=mask, group_size=self.group_size,
            kl=scored.kl_tok if a.kl_in_reward else None, kl_coef=a.kl_coef,
            values=scored.lp.values.to(self.device) if a.value_model else None,
            global_sum=(lambda x: all_reduce(x, self.world, self.device)) if self.world > 1 else None,
        )  # fmt: skip
        advantages, returns = adv.estimate(a.adv_estimator, inputs, a)
        if teacher_logp is not None:
            d = distill.distill_advantages(scored.logp, teacher_logp, mask, gamma=a.distill_gamma)
            parts = (a.task_coef * advantages, a.distill_coef * d)
            token_metrics.add(distill.distill_metrics(scored.logp, teacher_logp, *parts, mask), mask.sum())
            advantages = distill.combine(
                advantages, d, mask, task_coef=a.task_coef, distill_coef=a.distill_coef
            )
        zero_std = adv.zero_std_groups(rewards, self.group_size)
        masking = a.mask_zero_std_groups and not self.distill
        loss_mask = mask & ~zero_std[:, None] if masking else mask
        if a.overlong_filter:
            # Responses cut by the length cap leave the loss (their reward judges an unfinished answer).
            cut = torch.tensor([f == "length" for f in rb.finish_reasons], device=self.device)
            loss_mask = loss_mask & ~cut[:, None]
        return advantages, returns, zero_std, loss_mask

    def correction(self, rb: RolloutBatch, mask, loss_mask, scored: Scored, token_metrics: MetricMerger):
        """5. rollout correction: mismatch metrics, and IS weights over every sampled token (the rollout's
        drift, whether or not its group trains); rejection only narrows the loss mask further.
        Returns (IS weights or None, loss_mask)."""
        a = self.cfg.algo
        rollout_logp = rb.rollout_logprobs.to(self.device).float()
        probe_rollout = rollout_logp[: scored.probe.shape[0]]
        token_metrics.add(
            correction.mismatch_metrics(scored.logp, probe_rollout, scored.probe), scored.probe.sum()
        )
        rkl = correction.rollout_kl(scored.logp, probe_rollout, kind=a.rollout_kl_estimator)
        token_metrics.add({"rollout_kl": masked_mean(rkl, scored.probe)}, scored.probe.sum())
        if not a.rollout_is.enabled:
            return None, loss_mask
        c = a.rollout_is
        is_weights, kept, is_metrics = correction.rollout_is(
            scored.logp, rollout_logp, mask, level=c.level, mode=c.mode, upper=c.upper, lower=c.lower,
            veto_lower=c.veto_lower, veto_upper=c.veto_upper,
        )  # fmt: skip
        token_metrics.add(is_metrics, mask.sum())
        return is_weights, loss_mask & kept

    def token_staleness(self, rb: RolloutBatch, mask, loss_mask, step: int, token_metrics: MetricMerger):
        """5b. per-token staleness (policy versions between each token's sampler and `step`:
        rlkit.algos.staleness) and, with `algo.max_token_staleness`, the loss mask without the tokens older
        than that."""
        if rb.token_versions is None:
            return loss_mask
        versions = rb.token_versions.to(self.device)
        per_token, per_row = staleness.staleness_metrics(versions, mask, step)
        token_metrics.add(per_token, mask.sum())
        token_metrics.add(per_row, mask.shape[0])
        return staleness.fresh_tokens(versions, loss_mask, step, self.cfg.algo.max_token_staleness)

    def train_batch(
        self, rb: RolloutBatch, loss_mask, advantages, returns, is_weights, scored: Scored | None
    ) -> TrainBatch:
        """What `Learner.update` trains (the scoring pass's tensors only where the update uses them)."""
        a = self.cfg.algo
        lp = scored.lp if scored is not None else None
        return TrainBatch(
            prompt_ids=rb.prompt_ids.to(self.device),
            prompt_mask=rb.prompt_mask.to(self.device),
            response_ids=rb.response_ids.to(self.device),
            response_mask=loss_mask,
            advantages=advantages,
            old_logprobs=scored.logp if self.learner.off_policy else None,
            ref_logprobs=lp.ref_logprobs.to(self.device) if self.learner.kl_coef > 0 else None,
            rollout_logprobs=rb.rollout_logprobs.to(self.device).float() if a.rollout_kl_coef > 0 else None,
            is_weights=is_weights,
            token_versions=rb.token_versions.to(self.device) if rb.token_versions is not None else None,
            values=lp.values.to(self.device) if a.value_model else None,
            returns=returns,
        )
