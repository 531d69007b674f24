"""On-policy distillation: a teacher's per-token log-probs as a dense advantage on the policy's own samples.

The policy samples; a frozen teacher scores the sampled tokens; each token's reverse KL estimate

    r_t = log p_policy(y_t | y_<t) - log p_teacher(y_t | y_<t)

is a cost at every token instead of one reward per sequence (Agarwal et al. 2024, "On-Policy Distillation of
Language Models", arXiv:2306.13649; Thinking Machines, "On-Policy Distillation", 2025). The distillation
advantage is `-r_t` (the policy is pushed towards the tokens the teacher finds likelier than it does), detached:
no gradient flows through the teacher or through the advantage itself; the policy-gradient loss (rlkit/algos/
losses.py) carries the gradient, exactly as for a task advantage.

Choices, against the two references:

- **Discount** (`gamma`, `algo.distill_gamma`). 0 (the default) gives each token its own `-r_t`, as Thinking
  Machines do ("discount factor of zero": each step optimises the immediate next token), the lower-variance
  choice. 1 gives `-sum_{s>=t} r_s`, the score-function gradient of the whole sequence's reverse KL
  (the sequence-level objective of Agarwal et al.'s reverse-KL variant), at a higher variance.
- **No whitening.** The term is in nats and 0 exactly where the policy matches the teacher; whitening would
  erase that scale (and turn a matched token into a push). The task advantage keeps its own normalisation.
- **Combination.** `advantage = task_coef * A_task + distill_coef * A_distill`, token by token: GRPO's
  sequence advantage is broadcast over the row's tokens (as the estimators already return [N, T]).
- **Sampled token only.** The full-distribution variant (reverse KL over the top-k of the policy's
  distribution, needing the teacher's log-softmax at k ids per position inside the update) is not
  implemented: see docs/guides/distillation.md.

Shapes: N samples, T response tokens; `mask` bool or 0/1. Nothing here writes to its arguments; results are
float32 (float64 for float64 inputs), 0 at masked positions.
"""

from __future__ import annotations

import torch
from torch import Tensor

from rlkit.algos.advantages import discounted_returns
from rlkit.algos.common import as_bool_mask, as_float, masked

__all__ = ["reverse_kl", "distill_advantages", "combine", "distill_metrics", "teacher_share"]


def reverse_kl(logp: Tensor, teacher_logp: Tensor, mask: Tensor) -> Tensor:
    """[N, T] per-token reverse KL estimate `logp - teacher_logp` on the sampled tokens, 0 at masked positions.

    Its expectation over the policy's samples is KL(policy || teacher) at that position.
    """
    m = as_bool_mask(mask, logp)
    return masked(as_float(logp) - as_float(teacher_logp), m)


def distill_advantages(logp: Tensor, teacher_logp: Tensor, mask: Tensor, *, gamma: float = 0.0) -> Tensor:
    """[N, T] distillation advantage: `-reverse_kl` (gamma=0), or its discounted sum over the rest of the
    response `-(r_t + gamma * r_{t+1} + ...)` over valid tokens (masked positions skipped). Detached."""
    if not 0.0 <= gamma <= 1.0:
        raise ValueError(f"gamma={gamma} must be in [0, 1]")
    r = reverse_kl(logp.detach(), teacher_logp.detach(), mask)
    if gamma == 0.0:
        return -r
    return -discounted_returns(r, mask, gamma=gamma)


def combine(
    task: Tensor, distill: Tensor, mask: Tensor, *, task_coef: float = 1.0, distill_coef: float = 1.0
) -> Tensor:
    """[N, T] `task_coef * task + distill_coef * distill` on valid tokens, 0 elsewhere.

    `task`: [N] (one advantage per sequence, broadcast over its tokens) or [N, T]; `distill`: [N, T].
    """
    t = as_float(task)
    if t.dim() == 1:
        t = t[:, None].expand_as(distill)
    m = as_bool_mask(mask, distill)
    return masked(task_coef * t + distill_coef * as_float(distill), m)


def distill_metrics(
    logp: Tensor, teacher_logp: Tensor, task_part: Tensor, distill_part: Tensor, mask: Tensor
) -> dict[str, Tensor]:
    """Token means over `mask` (merge them token-weighted across micro-batches and ranks):

    distill/reverse_kl       mean of logp - teacher_logp on the sampled tokens
    distill/teacher_logprob  mean teacher log-prob of the sampled tokens
    distill/adv_abs          mean |distill_coef * distillation advantage|
    distill/task_adv_abs     mean |task_coef * task advantage|

    The teacher's share of the advantage is adv_abs / (adv_abs + task_adv_abs) (`teacher_share`).
    """
    m = as_bool_mask(mask, logp)
    n = m.sum().clamp(min=1)

    def mean(x: Tensor) -> Tensor:
        return masked(as_float(x), m).sum() / n

    return {
        "distill/reverse_kl": mean(reverse_kl(logp, teacher_logp, m)),
        "distill/teacher_logprob": mean(teacher_logp),
        "distill/adv_abs": mean(distill_part.abs()),
        "distill/task_adv_abs": mean(task_part.abs()),
    }


def teacher_share(adv_abs: Tensor, task_adv_abs: Tensor) -> Tensor:
    """The share of the advantage's magnitude that comes from the teacher (0 when both are 0)."""
    total = adv_abs + task_adv_abs
    return torch.where(
        total > 0, adv_abs / total.clamp(min=torch.finfo(total.dtype).tiny), torch.zeros_like(total)
    )
