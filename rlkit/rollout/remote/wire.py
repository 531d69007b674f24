"""The bridge: the process group of learner rank 0 and the rollout workers that carries the weights
(rlkit/weights.py's send / receive), apart from either side's own world. The queue messages are in
messages.py."""

from __future__ import annotations

import datetime

import torch.distributed as dist


def bridge(store, rank: int, size: int, backend: str, timeout_s: float):
    """The process group of learner rank 0 (rank 0) and the workers, apart from either side's own world, with
    trainer.collective_timeout_s as its timeout (NCCL's options carry it, as `init_process_group` sets them;
    without options NCCL's default of 10 minutes applies)."""
    timeout = datetime.timedelta(seconds=timeout_s)
    if backend == "nccl":
        options = dist.ProcessGroupNCCL.Options()
        options._timeout = timeout
        return dist.ProcessGroupNCCL(store, rank, size, options)
    return dist.ProcessGroupGloo(store, rank, size, timeout)
