"""Moving learner weights into the rollout engine after an update.

The learner yields (HF name, full tensor) one parameter at a time (FSDP2 shards gathered per
parameter), and the engine copies each into its own model as it arrives, so the push never holds a
second full copy of the model on one device.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Iterator

import torch
from torch import Tensor


def _counted(named: Iterable[tuple[str, Tensor]], stats: dict, dtype: torch.dtype | None) -> Iterator:
    for name, tensor in named:
        if dtype is not None:
            tensor = tensor.to(dtype)
        stats["num_tensors"] += 1
        stats["num_params"] += tensor.numel()
        stats["bytes"] += tensor.numel() * tensor.element_size()
        yield name, tensor


def push_weights(learner, engine, *, dtype: torch.dtype | None = None) -> dict[str, float]:
    """Stream `learner.named_weights()` into `engine.load_weights`; every rank must call it.

    `dtype` casts each tensor before it is handed over (e.g. bf16 for a bf16 engine, halving the
    bytes moved); None keeps the learner's dtype (fp32 master weights) and lets the engine cast.
    Returns stats: `seconds`, `num_tensors`, `num_params`, `bytes`, `gb_per_s`.
    """
    stats = {"num_tensors": 0, "num_params": 0, "bytes": 0}
    start = time.perf_counter()
    engine.load_weights(_counted(learner.named_weights(), stats, dtype))
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    if stats["num_tensors"] == 0:
        raise RuntimeError("push_weights: the learner exported no tensors")
    return {**stats, "seconds": seconds, "gb_per_s": stats["bytes"] / 1e9 / max(seconds, 1e-9)}
