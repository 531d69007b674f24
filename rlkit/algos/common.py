"""Small helpers shared by the math modules (private: not part of the public API)."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

# exp() arguments are clamped to this range so one outlier token cannot overflow to inf.
EXP_CLAMP = 20.0


def compute_dtype(x: Tensor) -> torch.dtype:
    """float32 for half/bfloat16/integer inputs (bf16 has ~3 significant digits), float64 stays float64."""
    return torch.promote_types(x.dtype, torch.float32) if x.is_floating_point() else torch.float32


def as_float(x: Tensor) -> Tensor:
    """`x` in its compute dtype (a new tensor only when a cast is needed; callers never write to it)."""
    return x.to(compute_dtype(x))


def as_bool_mask(mask: Tensor, like: Tensor | None = None, name: str = "mask") -> Tensor:
    """Accept a bool or 0/1 float/int mask; check its shape against `like`."""
    if like is not None and mask.shape != like.shape:
        raise ValueError(f"{name} has shape {tuple(mask.shape)}, expected {tuple(like.shape)}")
    return mask if mask.dtype == torch.bool else mask != 0


def masked(x: Tensor, mask: Tensor) -> Tensor:
    """`x` with padding set to 0. `where`, not `x * mask`: NaN * 0 is NaN, and so is inf * 0."""
    return torch.where(mask, x, torch.zeros((), dtype=x.dtype, device=x.device))


def safe_div(num: Tensor, den: Tensor) -> Tensor:
    """num / den, and 0 where den == 0 (an empty mask gives 0, not NaN); gradient-safe."""
    ok = den > 0
    return torch.where(ok, num / torch.where(ok, den, torch.ones_like(den)), torch.zeros_like(num))


def check_choice(name: str, value, choices: Sequence[str]) -> None:
    if value not in choices:
        raise ValueError(f"{name}={value!r} is not valid; choose one of {', '.join(map(repr, choices))}")


def check_groups(n: int, group_size) -> None:
    if not isinstance(group_size, int) or isinstance(group_size, bool) or group_size < 1:
        raise ValueError(
            f"group_size={group_size!r} is not valid; it must be an integer >= 1 that divides N={n}"
        )
    if n % group_size:
        raise ValueError(
            f"group_size={group_size} does not divide N={n}; valid group sizes are the divisors of N"
        )
