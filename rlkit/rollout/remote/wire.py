"""What crosses between the learner and the rollout workers: the pending batch type, the serialisation of
queue messages, and the process group of learner rank 0 and the workers."""

from __future__ import annotations

import dataclasses
import datetime
import io

import torch
import torch.distributed as dist

from rlkit.batch import ScoredBatch


@dataclasses.dataclass
class Pending:
    """A scored global batch the learner has received and not trained yet."""

    index: int
    """Its place in the sequence of granted batches (its sampling seeds derive from it)."""
    batch: ScoredBatch
    position: int
    """The data order's position after its prompts were drawn."""
    seconds: dict[str, float]
    """The worker's phase timers (timing/generate_s, timing/reward_s, ...)."""


def dumps(obj) -> bytes:
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


def loads(data: bytes):
    return torch.load(io.BytesIO(data), weights_only=False)


def bridge(store, rank: int, size: int, backend: str, timeout_s: float):
    """The process group of learner rank 0 (rank 0) and the workers, apart from either side's own world."""
    timeout = datetime.timedelta(seconds=timeout_s)
    if backend == "nccl":
        return dist.ProcessGroupNCCL(store, rank, size)
    return dist.ProcessGroupGloo(store, rank, size, timeout)
