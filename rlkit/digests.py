"""Digests of tensors, computed on the tensor's own device: one 64-bit number per tensor comes back to the host.

A push is verified by comparing, tensor by tensor, what the engine holds with what the learner pushed
(rlkit/weights.py `check_engine`). Copying every tensor to the host for sha256 costs a model's bytes over PCIe
on every rank and every push; this digest is computed where the tensor lives and only its result moves.

The digest of a tensor is a sum over its elements, modulo 2**64, of `mix(bits(x_p) + p * GOLDEN)`: `bits` is the
element's bit pattern as an integer (a float's -0.0 read as +0.0: the two are the same number, and a kernel that
recomputes a weight may give either), `p` its flat position, and `mix` the finaliser of MurmurHash3 (xor-shift,
odd multiply, xor-shift, odd multiply, xor-shift), a bijection of 64-bit integers. Why it is sound:

- any change of a single element is always detected: for a fixed position the term is a bijection of the
  element's bits (an odd multiple of the position is added, then a bijection applied), so the term changes and
  with it the sum;
- a change of several elements (two rows swapped, a stale block) goes unseen only if the mixed terms it changes
  sum to the same value modulo 2**64: the mixed terms behave as independent random 64-bit numbers, so this is a
  chance of about 2**-64 per change; a naive sum of the bits (or a sum weighted by position without the mix)
  cannot see a swap of equal-sum or proportional rows, which is why the position enters before the mix;
- a sum of per-element terms can be accumulated from pieces: `range_digest(values, start)` is the contribution of
  `values` placed at positions `start, start + 1, ...`, so the digest of a tensor that an engine assembles from
  several pushed tensors (vLLM's stacked q/k/v) is the sum of the pushed pieces' contributions at the positions
  the engine's loaders put them (rlkit/rollout/engines/vllm/content.py).

Two digests of equal values at equal positions are equal on any device (integer arithmetic, wrapping on overflow
as torch's int64 kernels do on CPU and CUDA): tests/leaves/test_digests.py holds it against a naive Python loop.
"""

from __future__ import annotations

import numpy as np
import torch
from torch import Tensor


def _signed(x: int) -> int:
    return x - (1 << 64) if x >= 1 << 63 else x


GOLDEN = _signed(0x9E3779B97F4A7C15)
M1 = _signed(0xFF51AFD7ED558CCD)
M2 = _signed(0xC4CEB9FE1A85EC53)
_LOW31 = (1 << 31) - 1
_MASK64 = (1 << 64) - 1
CHUNK = 1 << 16  # elements digested at a time on the CPU (512 KiB of uint64: in the cache)
_SHIFT = np.uint64(33)
DEVICE_CHUNK = 1 << 24  # ... on an accelerator (few kernel launches; temporaries of 2 x 128 MiB)
_WIDTH = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _patterns(values: Tensor) -> Tensor:
    """The elements' bit patterns as signed integers of the elements' width (a view where possible)."""
    if values.dtype == torch.bool:
        return values.to(torch.int8)
    if values.dtype in (torch.float16, torch.bfloat16, torch.float32, torch.float64):
        values = values + 0.0  # -0.0 -> +0.0 (IEEE round-to-nearest); every other value unchanged
    if values.is_complex():
        values = torch.view_as_real(values).reshape(-1)
    return values.contiguous().view(_WIDTH[values.element_size()])


def _bits(values: Tensor) -> Tensor:
    """The elements' bit patterns as int64 (sign-extended: still one integer per pattern)."""
    out = _patterns(values).to(torch.int64)
    return out.clone() if out.data_ptr() == values.data_ptr() else out  # an int64 input: never write into it


def _xorshift(x: Tensor, tmp: Tensor) -> None:
    """x ^= x >>> 33 in place (a logical shift: the arithmetic one, masked)."""
    torch.bitwise_right_shift(x, 33, out=tmp)
    x.bitwise_xor_(tmp.bitwise_and_(_LOW31))


def range_digest(values: Tensor, start: int = 0) -> Tensor:
    """The digest's contribution of `values` (flattened) at positions `start, start + 1, ...`: a 0-dim int64
    tensor on `values`' device (no copy to the host). Chunk by chunk, in place: on the CPU through numpy's
    unsigned 64-bit integers (logical shifts and wrapping products need no masks, and a call costs a
    microsecond: about 1.5x torch's int64 kernels on 2 cores), in chunks that stay in the cache."""
    flat = values.detach().reshape(-1)
    if flat.device.type == "cpu":
        return torch.tensor(_signed(_host_range_digest(_patterns(flat).numpy(), start)), dtype=torch.int64)
    total = torch.zeros((), dtype=torch.int64, device=flat.device)
    steps = torch.arange(min(DEVICE_CHUNK, flat.numel()), dtype=torch.int64, device=flat.device) * GOLDEN
    tmp = torch.empty_like(steps)
    for lo in range(0, flat.numel(), DEVICE_CHUNK):
        piece = flat[lo : lo + DEVICE_CHUNK]
        n = piece.numel()
        x = _bits(piece)  # a fresh int64 tensor
        x.add_(steps[:n]).add_(_signed(((start + lo) * GOLDEN) & _MASK64))  # + position * GOLDEN
        _xorshift(x, tmp[:n])
        x.mul_(M1)
        _xorshift(x, tmp[:n])
        x.mul_(M2)
        _xorshift(x, tmp[:n])
        total += x.sum()
    return total


def _host_range_digest(ints: np.ndarray, start: int) -> int:
    """range_digest on the host: `ints` are the bit patterns (signed, any width), sign-extended to 64 bits."""
    size = min(CHUNK, ints.size)
    steps = np.arange(size, dtype=np.uint64) * np.uint64(GOLDEN & _MASK64)
    x, tmp = np.empty(size, dtype=np.uint64), np.empty(size, dtype=np.uint64)
    total = np.uint64(0)
    with np.errstate(over="ignore"):
        for lo in range(0, ints.size, CHUNK):
            piece = ints[lo : lo + CHUNK]
            xv, tv = x[: piece.size], tmp[: piece.size]
            xv[...] = piece.astype(np.int64).view(np.uint64)
            xv += steps[: piece.size]
            xv += np.uint64(((start + lo) * GOLDEN) & _MASK64)  # + position * GOLDEN
            for mult in (M1, M2, None):
                np.right_shift(xv, _SHIFT, out=tv)
                xv ^= tv
                if mult is not None:
                    xv *= np.uint64(mult & _MASK64)
            total += xv.sum(dtype=np.uint64)
    return int(total)


def tensor_digest(tensor: Tensor) -> Tensor:
    """The digest of a whole tensor (its elements in row-major order), on its device."""
    return range_digest(tensor, 0)


def to_host(digests: dict[str, Tensor]) -> dict[str, str]:
    """{name: 0-dim digest on a device} as {name: 16 hex digits}, with one device-to-host copy per device."""
    out: dict[str, str] = {}
    by_device: dict[torch.device, list[str]] = {}
    for name, d in digests.items():
        by_device.setdefault(d.device, []).append(name)
    for names in by_device.values():
        values = torch.stack([digests[n] for n in names]).cpu().tolist()
        out.update({n: f"{v & ((1 << 64) - 1):016x}" for n, v in zip(names, values)})
    return out


def digest(tensor: Tensor) -> str:
    """The digest of one tensor, as 16 hex digits (one scalar copied to the host)."""
    return to_host({"": tensor_digest(tensor)})[""]
