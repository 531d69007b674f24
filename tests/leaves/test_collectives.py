"""rlkit.collectives under NCCL, on a CPU machine: the backend is faked (nothing is sent), so the device check
that stands before every tensor collective runs as it would on GPUs."""

from __future__ import annotations

import datetime
import os

import pytest
import torch
import torch.distributed as dist

from rlkit import collectives
from rlkit.collectives import CollectiveDeviceError, all_gather_cat, all_reduce, broadcast


class Work:
    """What a collective with async_op=True returns; records the timeouts its waits were given."""

    def __init__(self):
        self.waits = []

    def wait(self, timeout=None):
        self.waits.append(timeout)
        return True


def fake_backend(monkeypatch, backend: str) -> list:
    """The default group looks like `backend`'s; every collective it would run is recorded (tensor, work)."""
    sent = []

    def record(x):
        sent.append((x, Work()))
        return sent[-1][1]

    monkeypatch.setattr(dist, "is_available", lambda: True)
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_backend", lambda group=None: backend)
    monkeypatch.setattr(dist, "all_reduce", lambda x, op=None, group=None, async_op=False: record(x))
    monkeypatch.setattr(dist, "all_gather", lambda out, x, group=None, async_op=False: record(x))
    return sent


@pytest.fixture
def nccl(monkeypatch):
    return fake_backend(monkeypatch, "nccl")


def test_a_host_device_is_refused_by_name_under_nccl(nccl):
    counts = torch.tensor([3.0, 5.0, 7.0], dtype=torch.float64)  # what learner.update used to all-reduce
    for call in (
        lambda: all_reduce(counts, 2, "cpu"),
        lambda: all_gather_cat(counts, 2, torch.device("cpu")),
    ):
        with pytest.raises(CollectiveDeviceError, match=r"device cpu.*NCCL takes CUDA tensors only"):
            call()
    assert nccl == []  # refused before anything reached the backend


def test_the_device_is_a_required_argument():
    with pytest.raises(TypeError, match="device"):
        all_reduce(torch.ones(1), 1)  # the missing argument is the point
    with pytest.raises(TypeError, match="device"):
        all_gather_cat(torch.ones(1), 1)


def test_under_gloo_the_tensor_is_placed_on_the_given_device(monkeypatch):
    sent = fake_backend(monkeypatch, "gloo")
    x = torch.arange(6.0).reshape(2, 3).t()  # not contiguous
    out = all_reduce(x, 2, "cpu")
    assert (
        len(sent) == 1 and sent[0][0] is out and out.is_contiguous() and out is not x and torch.equal(out, x)
    )


def test_the_bridge_group_of_nccl_refuses_a_host_device(monkeypatch):
    class FakeNCCL:  # stands for torch.distributed.ProcessGroupNCCL, absent from CPU builds
        def broadcast(self, x, src):
            raise AssertionError("nothing may reach the group")

    monkeypatch.setattr(dist, "ProcessGroupNCCL", FakeNCCL, raising=False)
    with pytest.raises(CollectiveDeviceError, match="NCCL"):
        broadcast(FakeNCCL(), torch.ones(2), "cpu")
    assert collectives._backend(object()) == "gloo"


# -- a collective's timeout on NCCL reaches rlkit's explanation -----------------------------------


def test_rlkit_collectives_wait_on_the_host_with_the_collective_timeout(monkeypatch):
    """An NCCL work's plain wait() returns at once (it only orders the CUDA stream), so the timeout would be
    the watchdog's alone; rlkit's collectives wait on the host with trainer.collective_timeout_s."""
    sent = fake_backend(monkeypatch, "nccl")
    monkeypatch.setattr(collectives, "_host_timeout", None)
    collectives.CollectiveWatch(1, 37.0)  # one process: no group, but the timeout is taken
    with pytest.raises(CollectiveDeviceError):
        all_reduce(torch.ones(1), 2, "cpu")
    monkeypatch.setattr(collectives, "placed", lambda x, device, group=None: x)  # no CUDA here
    all_reduce(torch.ones(1), 2, "cuda")
    all_gather_cat(torch.ones(1), 2, "cuda")
    assert [w.waits for _, w in sent] == [[datetime.timedelta(seconds=37.0)]] * 2


@pytest.mark.parametrize(
    ("before", "after"), [(None, "2"), ("1", "2"), ("0", "0"), ("2", "2"), ("3", "3")], ids=str
)
def test_nccl_timeouts_are_let_through_to_python_unless_the_user_chose_otherwise(monkeypatch, before, after):
    """torch's default (3) and torchrun's (1) end the process from NCCL's watchdog thread; rlkit asks for
    CleanUpOnly (2) before the process group exists, and keeps a choice of 0 or 3."""
    if before is None:
        monkeypatch.delenv("TORCH_NCCL_ASYNC_ERROR_HANDLING", raising=False)
    else:
        monkeypatch.setenv("TORCH_NCCL_ASYNC_ERROR_HANDLING", before)
    collectives.let_nccl_timeouts_reach_python()
    assert os.environ["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == after


def test_the_learners_accelerator_on_cuda_sets_the_nccl_error_handling_first(monkeypatch):
    import accelerate

    from rlkit.config.schema import RLConfig
    from rlkit.learner import strategy

    seen = []

    class PartialState:
        def __init__(self, **kw):
            seen.append(os.environ.get("TORCH_NCCL_ASYNC_ERROR_HANDLING"))
            self.num_processes = 1

    monkeypatch.setenv("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1")  # what torchrun sets
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(accelerate, "PartialState", PartialState)
    monkeypatch.setattr(accelerate, "Accelerator", lambda **kw: None)
    strategy.make_accelerator(RLConfig())
    assert seen == ["2"]


@pytest.mark.parametrize(
    "text",
    [
        # torch/csrc/distributed/c10d/ProcessGroupNCCL.cpp: the watchdog's timeout, and the error of an
        # operation on the communicator it aborted (CleanUpOnly)
        "[Rank 1] Watchdog caught collective operation timeout: WorkNCCL(SeqNum=12, OpType=ALLREDUCE, "
        "NumelIn=3, NumelOut=3, Timeout(ms)=600000) ran for 600123 milliseconds before timing out.",
        "NCCL communicator was aborted on rank 0.",
        "[Rank 0] Work WorkNCCL(SeqNum=5, OpType=ALLGATHER) timed out in blocking wait.",
    ],
)
def test_nccls_timeout_errors_are_recognised(text):
    assert collectives.is_timeout(RuntimeError(text))
    assert not collectives.is_timeout(RuntimeError("CUDA out of memory"))


@pytest.mark.parametrize(
    ("collective_s", "heartbeat", "expected"),
    [(600, None, 240.0), (600, "480", 240.0), (60, None, 60.0), (600, "1200", 600.0), (3000, "2000", 1000.0)],
)
def test_the_explaining_barrier_ends_well_before_nccls_heartbeat_ends_the_rank(
    monkeypatch, collective_s, heartbeat, expected
):
    """Issue 61 item 9: torch's NCCL heartbeat monitor (TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC, 480 s unless set) ends
    every rank that long after a collective timeout; the barrier that names the stopped rank waits at most half
    of it (the explanation must print first), else trainer.collective_timeout_s."""
    if heartbeat is None:
        monkeypatch.delenv("TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC", raising=False)
    else:
        monkeypatch.setenv("TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC", heartbeat)
    waits = []
    monkeypatch.setattr(dist, "get_rank", lambda: 1)
    monkeypatch.setattr(
        dist,
        "monitored_barrier",
        lambda group, timeout, wait_all_ranks: waits.append(timeout.total_seconds()),
    )
    watch = object.__new__(collectives.CollectiveWatch)
    watch.timeout_s, watch.group, watch.places = collective_s, object(), []
    assert watch.explain(RuntimeError("Watchdog caught collective operation timeout")) is not None
    heartbeat_s = float(heartbeat or 480)
    assert waits == [expected] and waits[0] <= heartbeat_s / 2 and waits[0] <= collective_s
