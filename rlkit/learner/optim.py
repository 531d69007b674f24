"""AdamW, the learning-rate schedule, and one optimizer step (clip, step, schedule, zero).

A step whose loss or gradient norm is not finite is skipped without a host sync: the fused AdamW kernel
reads a `found_inf` tensor (the mechanism torch's GradScaler uses) and, when it is 1, leaves the
parameters, the moments and the step count untouched. The LR schedule cannot wait for the device, so it
steps anyway and `unschedule` takes the skipped steps back once the count reaches the host (the end of
`Learner.update`, where the metrics go to the host).
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from rlkit.config.rules import choice
from rlkit.learner.strategy import plain

LR_SCHEDULES = ("constant", "cosine")  # trainer.lr_schedule


class NonFiniteError(RuntimeError):
    """Too many optimizer steps in a row had a non-finite loss or gradient norm (trainer.max_nonfinite_steps)."""


def adamw(model: torch.nn.Module, trainer) -> torch.optim.Optimizer:
    """AdamW over the trainable parameters (with LoRA: the adapters only) with `trainer.*`'s settings."""
    params = [p for p in model.parameters() if p.requires_grad]
    # fused: the only AdamW that can skip a step on a device-side flag (`step(..., skip=...)`).
    return torch.optim.AdamW(
        params, lr=trainer.lr, betas=tuple(trainer.betas), weight_decay=trainer.weight_decay, fused=True
    )


def lr_lambda(warmup_steps: int, schedule: str, total_steps: int):
    """The LR multiplier at each optimizer step: linear warm-up, then constant or cosine to 0 at `total_steps`."""

    def fn(step: int) -> float:
        if step < warmup_steps:
            return (step + 1) / (warmup_steps + 1)
        if schedule == "constant":
            return 1.0
        progress = min(1.0, (step - warmup_steps) / max(1, total_steps - warmup_steps))
        return 0.5 * (1.0 + math.cos(math.pi * progress))

    return fn


def scheduler(optimizer: torch.optim.Optimizer, trainer, total_steps: int):
    # A plain LambdaLR stepped once per optimizer step: accelerate's wrapper steps it num_processes times
    # per call, which assumes a sharded dataloader we do not use.
    return torch.optim.lr_scheduler.LambdaLR(
        optimizer, lr_lambda(trainer.warmup_steps, trainer.lr_schedule, total_steps)
    )


def clip(accelerator, model, max_norm: float) -> Tensor:
    """Clip the gradients to `max_norm`; returns the norm before clipping (inf / NaN when they are not finite)."""
    return plain(accelerator.clip_grad_norm_(model.parameters(), max_norm))


def step(optimizer, scheduler, skip: Tensor) -> Tensor:
    """Step (unless `skip`, a 0-dim bool tensor on the parameters' device), schedule and zero the grads.

    Returns the step's lr. No host sync: a skipped step still advances the schedule; `unschedule` undoes it.
    """
    lr = torch.tensor(scheduler.get_last_lr()[0])
    inner = getattr(optimizer, "optimizer", optimizer)  # accelerate's AcceleratedOptimizer wraps it
    # Read by the fused kernel: 1 leaves the parameters, the moments and the step count as they were.
    inner.found_inf = skip.float()
    optimizer.step()
    scheduler.step()
    optimizer.zero_grad(set_to_none=True)
    return lr


def unschedule(scheduler, skipped: int) -> None:
    """Take back `skipped` schedule steps (of skipped optimizer steps), so the schedule counts applied steps."""
    if skipped <= 0:
        return
    scheduler.last_epoch -= skipped + 1
    scheduler.step()  # recomputes the learning rates of the optimizer's groups at the restored position


def check_nonfinite_run(
    run: int, step: int, metrics: dict[str, float], trainer, *, teacher: str | None = None
):
    """Raise `NonFiniteError` once `trainer.max_nonfinite_steps` optimizer steps in a row were skipped: the
    weights never took a non-finite update, but a run that cannot take a step is not training. When the
    distillation term is what is not finite (`teacher`: algo.teacher.path), the error names the teacher."""
    limit = trainer.max_nonfinite_steps
    if run < limit:
        return
    head = (
        f"step {step}: {run} optimizer steps in a row were skipped for a non-finite loss or gradient norm "
        f"(trainer.max_nonfinite_steps={limit}; loss/total={metrics.get('loss/total')}, grad_norm="
        f"{metrics.get('grad_norm')}). Those steps did not change the weights and no checkpoint was written "
        "from them. "
    )
    distill = {k: metrics.get(k) for k in ("distill/teacher_logprob", "distill/reverse_kl")}
    if teacher is not None and any(v is not None and not math.isfinite(v) for v in distill.values()):
        raise NonFiniteError(
            head
            + f"The distillation term is not finite ({', '.join(f'{k}={v}' for k, v in distill.items())}): "
            f"the teacher algo.teacher.path={teacher!r} gives non-finite log-probs (weights that overflow in "
            f"algo.teacher.dtype, or a broken checkpoint). Use another teacher, or algo.teacher.dtype=float32."
        )
    raise NonFiniteError(
        head + f"Likely causes: a learning rate too high (trainer.lr={trainer.lr}), rewards out of range "
        f"(reward/mean={metrics.get('reward/mean')}, reward/errors={metrics.get('reward/errors')}), or a loss "
        "term that overflows (algo.* coefficients, bf16). Resume from the last checkpoint with a lower "
        "trainer.lr, or check the reward function."
    )


def check_config(cfg) -> None:
    """`trainer.lr_schedule` (raises ConfigError)."""

    choice("trainer.lr_schedule", cfg.trainer.lr_schedule, LR_SCHEDULES)
