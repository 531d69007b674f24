"""Shared test inputs for tests/algos (imported by the test modules next to it)."""

import torch


def ragged_mask(n: int, t: int, gen: torch.Generator, *, interior: bool = True, empty_row: bool = True):
    """[n, t] bool: right-padded rows of random length, some with interior masked spans, one empty row."""
    mask = torch.zeros(n, t, dtype=torch.bool)
    for i in range(n):
        length = int(torch.randint(1, t + 1, (1,), generator=gen))
        mask[i, :length] = True
        if interior and length > 3 and i % 2 == 0:
            start = int(torch.randint(1, length - 2, (1,), generator=gen))
            mask[i, start : start + 2] = False
    if empty_row:
        mask[n // 2] = False
    return mask


def fill_padding(x: torch.Tensor, mask: torch.Tensor, value: float) -> torch.Tensor:
    """x with `value` (NaN, inf, 1e6) written at masked positions (a new tensor)."""
    return torch.where(mask.bool(), x, torch.full_like(x, value))


GARBAGE = (float("nan"), float("inf"), float("-inf"), 1e6)
