"""A driver older than the CUDA build of torch: the driver lists GPUs (nvidia-smi) but
torch sees none. Refused at start-up by name, before any model loads; both sides faked."""

from __future__ import annotations

import shutil
import subprocess

import pytest
import torch

from rlkit.config.schema import ConfigError, RLConfig
from rlkit.learner import strategy


def fake_machine(monkeypatch, *, listed: str | None, torch_sees: bool):
    """nvidia-smi answering with `listed` (None: not installed), and torch seeing a GPU or not."""
    real_which = shutil.which
    smi = "/usr/bin/nvidia-smi" if listed is not None else None
    monkeypatch.setattr(
        shutil, "which", lambda name, *a, **k: smi if name == "nvidia-smi" else real_which(name, *a, **k)
    )

    def run(cmd, **kw):
        assert cmd[0] == "nvidia-smi" and "--query-gpu=name,driver_version" in cmd
        return subprocess.CompletedProcess(cmd, 0, stdout=listed, stderr="")

    monkeypatch.setattr(subprocess, "run", run)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: torch_sees)
    monkeypatch.setattr(torch.version, "cuda", "13.0")


H100S = "NVIDIA H100 80GB HBM3, 550.54.15\nNVIDIA H100 80GB HBM3, 550.54.15\n"


@pytest.mark.parametrize("device", ["auto", "cuda"])
def test_gpus_the_driver_lists_but_torch_cannot_use_are_refused_by_name(monkeypatch, device):
    fake_machine(monkeypatch, listed=H100S, torch_sees=False)
    cfg = RLConfig()
    cfg.trainer.device = device
    with pytest.raises(ConfigError) as e:
        strategy.check_config(cfg)
    text = str(e.value)
    for part in (
        "2 NVIDIA GPU(s)",
        "NVIDIA H100 80GB HBM3",
        "550.54.15",
        "built for CUDA 13.0",
        "580",
        "trainer.device=cpu",
    ):
        assert part in text, (part, text)


@pytest.mark.parametrize(
    ("listed", "torch_sees", "device"),
    [(H100S, True, "auto"), (None, False, "auto"), ("", False, "auto"), (H100S, False, "cpu")],
    ids=["torch-sees-them", "no-driver", "driver-lists-none", "cpu-asked"],
)
def test_every_other_machine_passes(monkeypatch, listed, torch_sees, device):
    fake_machine(monkeypatch, listed=listed, torch_sees=torch_sees)
    cfg = RLConfig()
    cfg.trainer.device = device
    strategy.check_config(cfg)
