"""AdamW, the learning-rate schedule, and one optimizer step (clip, step, schedule, zero)."""

from __future__ import annotations

import math

import torch
from torch import Tensor

from rlkit.config.rules import choice
from rlkit.learner.strategy import plain

LR_SCHEDULES = ("constant", "cosine")  # trainer.lr_schedule


def adamw(model: torch.nn.Module, trainer) -> torch.optim.Optimizer:
    """AdamW over the trainable parameters (with LoRA: the adapters only) with `trainer.*`'s settings."""
    params = [p for p in model.parameters() if p.requires_grad]
    return torch.optim.AdamW(
        params, lr=trainer.lr, betas=tuple(trainer.betas), weight_decay=trainer.weight_decay
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


def step(accelerator, model, optimizer, scheduler, max_norm: float) -> tuple[Tensor, Tensor]:
    """Clip the gradient norm, step, schedule and zero the grads; returns (grad norm before clipping, lr)."""
    norm = accelerator.clip_grad_norm_(model.parameters(), max_norm)
    lr = torch.tensor(scheduler.get_last_lr()[0])
    optimizer.step()
    scheduler.step()
    optimizer.zero_grad(set_to_none=True)
    return plain(norm), lr


def check_config(cfg) -> None:
    """`trainer.lr_schedule` (raises ConfigError)."""

    choice("trainer.lr_schedule", cfg.trainer.lr_schedule, LR_SCHEDULES)
