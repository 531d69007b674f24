"""`trainer.device=cpu` on a machine with GPUs (faked: torch.cuda.is_available() is True): the learner's
accelerate state is built with cpu=True, so it runs on the CPU over gloo as asked."""

from __future__ import annotations

import accelerate
import pytest
import torch

from rlkit.config.schema import RLConfig
from rlkit.learner import strategy


@pytest.fixture
def built(monkeypatch):
    """What make_accelerator asks accelerate for (recorded: nothing is built) on a machine that has GPUs."""
    calls = []

    class Recorder:
        def __init__(self, **kwargs):
            calls.append((type(self).__name__, kwargs))
            self.num_processes = 1

    class PartialState(Recorder):
        pass

    class Accelerator(Recorder):
        pass

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(accelerate, "PartialState", PartialState)
    monkeypatch.setattr(accelerate, "Accelerator", Accelerator)
    return calls


@pytest.mark.parametrize(("device", "cpu"), [("cpu", True), ("auto", False), ("cuda", False)])
def test_the_learner_takes_the_configured_device(built, device, cpu):
    cfg = RLConfig()
    cfg.trainer.device = device
    strategy.make_accelerator(cfg)
    assert [(name, kw["cpu"]) for name, kw in built] == [("PartialState", cpu), ("Accelerator", cpu)]
