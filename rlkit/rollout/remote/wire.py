"""The bridge: the process group of learner rank 0 and the rollout workers that carries the weights
(rlkit/weights.py's send / receive), apart from either side's own world. The queue messages are in
messages.py."""

from __future__ import annotations

import datetime

import torch.distributed as dist


def bridge(store, rank: int, size: int, backend: str, timeout_s: float):
    """The process group of learner rank 0 (rank 0) and the workers, apart from either side's own world."""
    timeout = datetime.timedelta(seconds=timeout_s)
    if backend == "nccl":
        return dist.ProcessGroupNCCL(store, rank, size)
    return dist.ProcessGroupGloo(store, rank, size, timeout)
