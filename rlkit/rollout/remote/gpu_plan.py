"""The memory of an async rollout worker's GPU when a reward model (`reward.model`) shares it with the vLLM engine.

A worker's engine is not colocated with a learner: it takes vLLM's own default share of its GPU (0.92 in vLLM
0.32: `rlkit.rollout.engines.vllm.memory.memory_plan`) and does not sleep. The reward model is loaded onto the
same GPU after the engine; with the engine holding 92%, a 7-8B reward model (15-16 GB in bf16) does not fit. The
plan: the engine's share is vLLM's default less the reward model's need (its weights and `REWARD_ACTIVATIONS` of
them for its forward passes), checked at start-up (`check_reward_model_fits`, from the learner's preflight),
applied in the worker (`engine_kwargs_beside_reward_model`); where the engine would keep less than the policy's
weights and `MIN_KV_GIB` of KV cache, the run is refused with the numbers. A user's own
`rollout.engine_kwargs.gpu_memory_utilization` is kept, and refused when the two do not fit together.
"""

from __future__ import annotations

import torch

from rlkit.config.schema import ConfigError
from rlkit.models import resolve_model
from rlkit.rollout.engines import resolve_engine, torch_dtype
from rlkit.rollout.engines.vllm import platform as vllm_platform

GIB = 2**30
# The reward model's forward batches (reward.model_batch_size sequences) need memory beyond its weights.
REWARD_ACTIVATIONS = 0.25
# The least KV cache a worker's engine must keep beside the policy's weights.
MIN_KV_GIB = 1.0


def weight_bytes(path: str, dtype: torch.dtype, *, classifier: bool = False) -> int:
    """Bytes of the model at `path` in `dtype`, from its config alone (built on the meta device: nothing loads);
    `classifier`: as a sequence-classification model with one output (a reward model)."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForSequenceClassification

    directory, gguf_file = resolve_model(path)
    config = AutoConfig.from_pretrained(directory, **({"gguf_file": gguf_file} if gguf_file else {}))
    if classifier:
        config.num_labels = 1
    auto = AutoModelForSequenceClassification if classifier else AutoModelForCausalLM
    with torch.device("meta"):
        model = auto.from_config(config)
    seen, total = set(), 0
    for p in model.parameters():  # a tied tensor once
        if id(p) not in seen:
            seen.add(id(p))
            total += p.numel()
    return total * torch.empty((), dtype=dtype).element_size()


def engine_share(
    *, total: int, vllm_default: float, reward_bytes: int, policy_bytes: int, user_share: float | None = None
) -> float:
    """The engine's `gpu_memory_utilization` on a worker GPU of `total` bytes that a reward model of
    `reward_bytes` weights shares; raises ConfigError with the numbers where they do not fit."""
    need = reward_bytes * (1 + REWARD_ACTIVATIONS)
    share = user_share if user_share is not None else vllm_default - need / total
    numbers = (
        f"the reward model (reward.model) needs {need / GIB:.1f} GiB ({reward_bytes / GIB:.1f} GiB of weights and "
        f"{REWARD_ACTIVATIONS:.0%} for its forward passes) on each rollout worker's {total / GIB:.1f} GiB GPU"
    )
    if user_share is not None and (share * total + need) > vllm_default * total:
        raise ConfigError(
            f"trainer.mode=async: rollout.engine_kwargs.gpu_memory_utilization={user_share} gives the engine "
            f"{share * total / GIB:.1f} GiB and {numbers}: together more than vLLM's {vllm_default:.0%} of the GPU. "
            f"Use at most gpu_memory_utilization={max(0.0, vllm_default - need / total):.2f}, leave it unset "
            "(rlkit plans it), or a smaller reward model"
        )
    engine_bytes = share * total
    least = policy_bytes + MIN_KV_GIB * GIB
    if engine_bytes < least:
        raise ConfigError(
            f"trainer.mode=async: {numbers}, which leaves the vLLM engine {max(engine_bytes, 0) / GIB:.1f} GiB "
            f"(gpu_memory_utilization={share:.2f}), less than the policy's {policy_bytes / GIB:.1f} GiB of weights "
            f"and {MIN_KV_GIB:g} GiB of KV cache. Use a smaller reward model (reward.model), GPUs with more "
            "memory, or trainer.mode=sync (where the engine sleeps while the reward model scores)"
        )
    return round(share, 4)


def gpu_total_bytes(index: int) -> int:
    """The memory of visible GPU `index`."""
    return torch.cuda.get_device_properties(index).total_memory


def _share(cfg, gpu_index: int) -> float:
    dtype = torch_dtype(cfg.model.dtype)
    return engine_share(
        total=gpu_total_bytes(gpu_index), vllm_default=vllm_platform.vllm_default("gpu_memory_utilization"),
        reward_bytes=weight_bytes(cfg.reward.model, dtype, classifier=True),
        policy_bytes=weight_bytes(cfg.model.path, dtype),
        user_share=(cfg.rollout.engine_kwargs or {}).get("gpu_memory_utilization"),
    )  # fmt: skip


def applies(cfg, engine: str) -> bool:
    """Whether a reward model shares an async worker's GPU with a vLLM engine."""
    return cfg.trainer.mode == "async" and cfg.reward.model is not None and engine == "vllm"


def check_reward_model_fits(cfg, engine: str) -> None:
    """Start-up (learner rank 0's preflight, where the workers' GPUs are visible): refuse a reward model that does
    not fit beside the worker's engine, with the numbers (the last visible GPU stands for the workers')."""
    if applies(cfg, engine) and cfg.trainer.device != "cpu" and torch.cuda.is_available():
        _share(cfg, torch.cuda.device_count() - 1)


def engine_kwargs_beside_reward_model(cfg, device: torch.device) -> dict:
    """A worker's `rollout.engine_kwargs`, with the planned `gpu_memory_utilization` where a reward model shares
    its GPU (on CUDA) with a vLLM engine and the user set none."""
    kwargs = dict(cfg.rollout.engine_kwargs or {})
    if device.type != "cuda" or cfg.reward.model is None or "gpu_memory_utilization" in kwargs:
        return kwargs
    if applies(
        cfg, resolve_engine(cfg.rollout.engine, cfg.model.path, log_pick=False, dtype=cfg.model.dtype)
    ):
        kwargs["gpu_memory_utilization"] = _share(cfg, device.index or 0)
    return kwargs
