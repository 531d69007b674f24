"""Values the run derives from its config, computed once here (the learner, the step and the reuse check read
them; nothing recomputes them from the keys)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Derived:
    """What follows from an `RLConfig`; `derive(cfg)` builds it."""

    optimizer_steps: int
    """Optimizer steps of the whole run: trainer.steps x algo.ppo_epochs x algo.mini_batches (the LR schedule's
    length, the warm-up's bound)."""
    off_policy: bool
    """More than one optimizer step per batch: every step after the first trains a batch its sampler did not
    see, so the update needs the behaviour policy's log-probs (`old_logprobs`). With one step per batch the
    PPO ratio is exactly 1 (rlkit.algos.losses.ppo_clip: the clip never acts), unless rollout IS weights the
    tokens: the loss is then REINFORCE with the estimator's baseline."""
    kl_loss_coef: float
    """The coefficient of the KL-to-reference LOSS term: algo.kl_coef, or 0 when the KL goes into the reward
    (algo.kl_in_reward; then algo.kl_coef shapes the token rewards instead)."""
    needs_reference: bool
    """A frozen reference model is scored (algo.kl_coef > 0: as a loss term or in the reward)."""
    has_teacher: bool
    """On-policy distillation from a teacher (algo.distill_coef > 0)."""
    norm_len: int
    """The length normaliser of `seq-mean-token-sum-norm` (algo.norm_len, else rollout.max_new_tokens)."""
    score_every_row: bool
    """The update needs the current policy's log-probs of every row before it runs (IS weights, the off-policy
    ratio's denominator, the KL to the reference, the critic's baseline, the teacher's term); otherwise phase 3
    scores only rollout.mismatch_samples rows for the mismatch metrics."""


def derive(cfg) -> Derived:
    """The `Derived` values of `cfg` (an `RLConfig`)."""
    a, t = cfg.algo, cfg.trainer
    steps_per_batch = a.ppo_epochs * a.mini_batches
    off_policy = steps_per_batch > 1
    has_teacher = a.distill_coef > 0
    needs_reference = a.kl_coef > 0
    return Derived(
        optimizer_steps=t.steps * steps_per_batch,
        off_policy=off_policy,
        kl_loss_coef=0.0 if a.kl_in_reward else a.kl_coef,
        needs_reference=needs_reference,
        has_teacher=has_teacher,
        norm_len=a.norm_len if a.norm_len is not None else cfg.rollout.max_new_tokens,
        score_every_row=bool(
            a.rollout_is.enabled or off_policy or needs_reference or a.value_model or has_teacher
        ),
    )
