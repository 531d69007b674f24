"""Async mode with a reward model (issue 61 item 5): the reward model is loaded onto each rollout worker's GPU,
where the vLLM engine takes vLLM's default 92% without sleeping; the engine's share is planned for the reward
model, and a reward model that does not fit is refused at start-up with the numbers (gpu_plan.py)."""

from __future__ import annotations

import pytest
import torch

from rlkit.config.schema import ConfigError, RLConfig
from rlkit.rollout.remote import gpu_plan

GIB = 2**30


def test_the_engine_leaves_the_reward_model_its_weights_and_activations():
    # 16 GiB of reward-model weights + 25% = 20 GiB of an 80 GiB GPU: 0.92 - 20/80 = 0.67 for the engine.
    share = gpu_plan.engine_share(
        total=80 * GIB, vllm_default=0.92, reward_bytes=16 * GIB, policy_bytes=1 * GIB
    )
    assert share == pytest.approx(0.67)
    assert share * 80 + 20 == pytest.approx(0.92 * 80)  # together: vLLM's default share, no more


def test_a_reward_model_that_leaves_the_engine_too_little_is_refused_with_the_numbers():
    # 24 GiB GPU: 0.92 - 17.5/24 = 0.191 -> 4.58 GiB for the engine, less than 4 GiB policy + 1 GiB KV cache.
    with pytest.raises(ConfigError) as e:
        gpu_plan.engine_share(total=24 * GIB, vllm_default=0.92, reward_bytes=14 * GIB, policy_bytes=4 * GIB)
    for text in (
        "reward.model",
        "17.5 GiB",
        "24.0 GiB",
        "4.6 GiB",
        "4.0 GiB of weights",
        "trainer.mode=sync",
    ):
        assert text in str(e.value), (text, str(e.value))
    # With 3 GiB of policy weights it fits (4.58 >= 4).
    gpu_plan.engine_share(total=24 * GIB, vllm_default=0.92, reward_bytes=14 * GIB, policy_bytes=3 * GIB)


def test_a_users_share_that_leaves_no_room_for_the_reward_model_is_refused():
    kwargs = dict(total=80 * GIB, vllm_default=0.92, reward_bytes=16 * GIB, policy_bytes=GIB)
    with pytest.raises(
        ConfigError, match=r"gpu_memory_utilization=0\.9 .*at most gpu_memory_utilization=0\.67"
    ):
        gpu_plan.engine_share(**kwargs, user_share=0.9)
    assert gpu_plan.engine_share(**kwargs, user_share=0.5) == 0.5


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from rlkit.models import make_tiny_checkpoint

    return make_tiny_checkpoint(tmp_path_factory.mktemp("rm"), hidden_size=64, num_layers=1)


def test_weight_bytes_are_counted_from_the_config_without_loading(tiny):
    from transformers import AutoModelForSequenceClassification

    model = AutoModelForSequenceClassification.from_pretrained(tiny, num_labels=1)
    numel = sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())
    assert gpu_plan.weight_bytes(tiny, torch.bfloat16, classifier=True) == 2 * numel
    assert gpu_plan.weight_bytes(tiny, torch.float32, classifier=True) == 4 * numel


def _async_cfg(tiny) -> RLConfig:
    cfg = RLConfig()
    cfg.model.path, cfg.model.dtype, cfg.reward.model = tiny, "float32", tiny
    cfg.trainer.mode, cfg.rollout.engine = "async", "vllm"
    return cfg


def test_a_worker_on_a_gpu_builds_its_engine_with_the_planned_share(monkeypatch, tiny):
    from rlkit.rollout.engines.vllm import platform as vllm_platform
    from rlkit.rollout.remote import worker

    made = []
    monkeypatch.setattr(
        worker, "LocalRollouts", lambda cfg, **kw: made.append(dict(cfg.rollout.engine_kwargs))
    )
    monkeypatch.setattr(worker, "load_tokenizer", lambda path: None)
    monkeypatch.setattr(gpu_plan, "gpu_total_bytes", lambda index: 4 * GIB)
    monkeypatch.setattr(vllm_platform, "vllm_default", lambda name: 0.92)
    cfg = _async_cfg(tiny)
    worker.worker_rollouts(cfg, 0, 1, torch.device("cuda", 0))
    reward = gpu_plan.weight_bytes(tiny, torch.float32, classifier=True)
    assert made[0]["gpu_memory_utilization"] == pytest.approx(0.92 - 1.25 * reward / (4 * GIB), abs=1e-4)
    assert cfg.rollout.engine_kwargs == {}  # the worker's copy changed, not the config it was given
    worker.worker_rollouts(cfg, 0, 1, torch.device("cpu"))  # on CPU: vLLM's KV cache size, no share
    cfg.reward.model = None
    worker.worker_rollouts(cfg, 0, 1, torch.device("cuda", 0))
    assert made[1:] == [{}, {}]


def test_the_preflight_refuses_a_reward_model_that_does_not_fit_a_workers_gpu(monkeypatch, tiny):
    from rlkit.rollout.engines.vllm import platform as vllm_platform

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(vllm_platform, "vllm_default", lambda name: 0.92)
    monkeypatch.setattr(gpu_plan, "gpu_total_bytes", lambda index: 2**20)  # 1 MiB: nothing fits
    cfg = _async_cfg(tiny)
    cfg.trainer.device = "cuda"
    with pytest.raises(ConfigError, match="reward model .*needs .* GiB"):
        gpu_plan.check_reward_model_fits(cfg, "vllm")
    gpu_plan.check_reward_model_fits(cfg, "hf")  # the HF engine takes no share up front
