"""trainer.mode=async on GPUs: the rollout workers take the last trainer.rollout_gpus visible GPUs and the
learner processes of the machine the first ones, by LOCAL_RANK. Under torchrun the launcher decides how many
learner processes there are; a count that makes them share GPUs with the workers is refused at start-up
(it would deadlock on GPUs). The device count and the launcher's variables are faked."""

from __future__ import annotations

import pytest
import torch

from rlkit.config.schema import ConfigError, RLConfig
from rlkit.rollout.remote import client

LAUNCHER = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE")


def async_cfg(rollout_gpus: int) -> RLConfig:
    cfg = RLConfig()
    cfg.trainer.mode, cfg.trainer.rollout_gpus, cfg.trainer.steps = "async", rollout_gpus, 10
    cfg.trainer.train_batch_size, cfg.rollout.group_size = 64, 8
    return cfg


def machine(monkeypatch, gpus: int, **launcher):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: gpus > 0)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: gpus)
    for key in LAUNCHER:
        monkeypatch.delenv(key, raising=False)
    for key, value in launcher.items():
        monkeypatch.setenv(key, str(value))


def torchrun(nproc: int, rank: int = 0, nodes: int = 1) -> dict:
    """The variables torchrun sets in the process of global rank `rank`."""
    return {"RANK": rank, "LOCAL_RANK": rank % nproc, "WORLD_SIZE": nproc * nodes, "LOCAL_WORLD_SIZE": nproc}


@pytest.mark.parametrize("rank", [0, 3, 7])
def test_torchrun_on_every_gpu_with_async_is_refused_naming_the_shared_gpus(monkeypatch, rank):
    machine(monkeypatch, 8, **torchrun(8, rank))
    with pytest.raises(ConfigError) as e:
        client.check_config(async_cfg(rollout_gpus=2))
    text = str(e.value)
    # Workers on GPUs 6 and 7, learner ranks on 0..7: 6 and 7 are shared; 6 processes per machine fit.
    assert "8 learner processes" in text and "need 10 GPUs, 8 visible" in text, text
    assert "GPUs [6, 7]" in text and "--nproc-per-node 6" in text, text


@pytest.mark.parametrize(
    ("gpus", "launcher", "rollout_gpus"),
    [
        (8, torchrun(6), 2),  # 6 learner processes + 2 workers = 8
        (8, torchrun(4), 2),  # two GPUs idle, none shared
        (8, {}, 2),  # python -m rlkit.train: it starts 8 - 2 processes itself
        (8, torchrun(8, rank=8, nodes=2), 2),  # a second machine: no workers run there
        (0, torchrun(8), 2),  # no GPU: the workers are CPU processes
    ],
    ids=["fills", "idle", "own-launcher", "second-node", "cpu"],
)
def test_layouts_where_no_gpu_is_shared_pass(monkeypatch, gpus, launcher, rollout_gpus):
    machine(monkeypatch, gpus, **launcher)
    client.check_config(async_cfg(rollout_gpus))
