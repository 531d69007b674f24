"""rlkit.collectives under NCCL, on a CPU machine: the backend is faked (nothing is sent), so the device check
that stands before every tensor collective runs as it would on GPUs."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from rlkit import collectives
from rlkit.collectives import CollectiveDeviceError, all_gather_cat, all_reduce, broadcast


@pytest.fixture
def nccl(monkeypatch):
    """The default group looks like NCCL's; every collective it would run is recorded instead."""
    sent = []
    monkeypatch.setattr(dist, "is_available", lambda: True)
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_backend", lambda group=None: "nccl")
    monkeypatch.setattr(dist, "all_reduce", lambda x, op=None, group=None: sent.append(x))
    monkeypatch.setattr(dist, "all_gather", lambda out, x, group=None: sent.append(x))
    return sent


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
    sent = []
    monkeypatch.setattr(dist, "is_available", lambda: True)
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_backend", lambda group=None: "gloo")
    monkeypatch.setattr(dist, "all_reduce", lambda x, op=None, group=None: sent.append(x))
    x = torch.arange(6.0).reshape(2, 3).t()  # not contiguous
    out = all_reduce(x, 2, "cpu")
    assert sent == [out] and out.is_contiguous() and out is not x and torch.equal(out, x)


def test_the_bridge_group_of_nccl_refuses_a_host_device(monkeypatch):
    class FakeNCCL:  # stands for torch.distributed.ProcessGroupNCCL, absent from CPU builds
        def broadcast(self, x, src):
            raise AssertionError("nothing may reach the group")

    monkeypatch.setattr(dist, "ProcessGroupNCCL", FakeNCCL, raising=False)
    with pytest.raises(CollectiveDeviceError, match="NCCL"):
        broadcast(FakeNCCL(), torch.ones(2), "cpu")
    assert collectives._backend(object()) == "gloo"
