"""Wall-clock timers of a step's phases (`timing/<phase>_s`) and the process's peak memory."""

from __future__ import annotations

import contextlib
import resource
import time

import torch


class Timers:
    """`with timers("generate"): ...` accumulates wall seconds under `timing/generate_s`."""

    def __init__(self):
        self.seconds: dict[str, float] = {}

    @contextlib.contextmanager
    def __call__(self, name: str):
        start = time.perf_counter()
        try:
            yield
        finally:
            if torch.cuda.is_available():
                torch.cuda.synchronize()  # GPU work is asynchronous: time it to completion
            self.add(name, time.perf_counter() - start)

    def add(self, name: str, seconds: float) -> None:
        """Add `seconds` to phase `name` (e.g. a phase another process timed)."""
        key = f"timing/{name}_s"
        self.seconds[key] = self.seconds.get(key, 0.0) + seconds


def peak_memory_gb() -> float:
    """Peak CUDA memory allocated by this process, or its peak resident set size on CPU (GiB)."""
    if torch.cuda.is_available():
        return torch.cuda.max_memory_allocated() / 2**30
    # ru_maxrss is KiB on Linux
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
