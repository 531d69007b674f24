"""The vLLM engine's settings: a pure function from rlkit's engine arguments, the model's config and the platform
to the arguments of `vllm.LLM` (no vllm import; tests/rollout/test_vllm_settings.py runs every branch without it).

The constructor (vllm/engine.py) reads the platform, calls `engine_settings` and builds the LLM with its result.
"""

from __future__ import annotations

import dataclasses

import torch

from rlkit.rollout.engines.vllm.memory import memory_plan
from rlkit.rollout.engines.vllm.platform import prefix_caching

CPU_KV_CACHE_GIB = 1.0  # on the CPU vLLM would read gpu_memory_utilization as a share of host RAM


@dataclasses.dataclass(frozen=True)
class EngineSettings:
    """What `engine_settings` decided: the keyword arguments of `vllm.LLM` (all but the model and tokenizer
    paths) and the values the engine logs and keeps."""

    llm_kwargs: dict
    enforce_eager: bool
    enable_sleep_mode: bool
    gpu_memory_utilization: float
    kv_cache_gib: float | None


def engine_settings(
    config,
    *,
    dtype: str | torch.dtype,
    seed: int,
    rank: int,
    platform: str,
    sleep_available: bool,
    default_gpu_memory_utilization: float,
    gpu_memory_utilization: float | None = None,
    kv_cache_gib: float | None = None,
    enforce_eager: bool | None = None,
    max_model_len: int | None = None,
    enable_sleep_mode: bool | None = None,
    sleep_level: int = 2,
    max_num_batched_tokens: int = 4096,
    enable_prefix_caching: bool | None = None,
    colocated: bool = True,
    routing_replay: bool = False,
    **llm_kwargs,
) -> EngineSettings:
    """The arguments of `vllm.LLM` for the model of `config` (transformers' config) on this platform (`platform`:
    vLLM's device type, "cpu" or "cuda"; `sleep_available`: whether it has sleep mode;
    `default_gpu_memory_utilization`: EngineArgs' default).
    `ValueError` naming the argument for a value vLLM would take badly. The keyword arguments are VLLMEngine's
    (see its docstring); `llm_kwargs` pass through, rlkit's choices only filling what they leave unset."""
    llm_kwargs = dict(llm_kwargs)
    on_cpu = platform == "cpu"
    if routing_replay:  # each completion returns its tokens' experts (vLLM's Model Runner V2 only)
        llm_kwargs["enable_return_routed_experts"] = True
    if sleep_level not in (1, 2):
        raise ValueError(f"sleep_level={sleep_level} must be 1 or 2")
    gpu_memory_utilization, enable_sleep_mode = memory_plan(
        colocated, gpu_memory_utilization, enable_sleep_mode, sleep_available=sleep_available,
        vllm_default=default_gpu_memory_utilization,
    )  # fmt: skip
    if not 0 < gpu_memory_utilization <= 1:
        raise ValueError(f"gpu_memory_utilization={gpu_memory_utilization} must be in (0, 1]")
    if enable_sleep_mode and not sleep_available:
        raise ValueError(
            f"rollout.engine_kwargs.enable_sleep_mode=true: vLLM has no sleep mode on its {platform} platform; "
            "leave it unset (auto) or false"
        )
    if kv_cache_gib is None and on_cpu:
        kv_cache_gib = CPU_KV_CACHE_GIB
    if kv_cache_gib is not None:
        if kv_cache_gib <= 0:
            raise ValueError(f"kv_cache_gib={kv_cache_gib} must be > 0 (GiB of KV cache)")
        llm_kwargs["kv_cache_memory_bytes"] = int(kv_cache_gib * 2**30)
    if enforce_eager is None:
        enforce_eager = on_cpu  # compilation costs ~80 s at start-up on the CPU
    dtype_name = str(dtype).removeprefix("torch.")
    if on_cpu:
        # Whole prefills only: see VLLMEngine's docstring (seeded requests, CPU generators).
        # A vision-language config holds its context in its text config (Idefics3's max_position_embeddings).
        text = config.get_text_config() if hasattr(config, "get_text_config") else config
        context = max_model_len or getattr(text, "max_position_embeddings", None) or 0
        llm_kwargs.setdefault("enable_chunked_prefill", False)
        max_num_batched_tokens = max(max_num_batched_tokens, context)
        if getattr(config, "kv_lora_rank", None) and dtype_name == "float32":
            # An fp32 MLA model (DeepSeek): vLLM picks its AMX MLA backend where the CPU has AMX tiles, whose
            # weight packing takes no fp32 ("expect weight to be bfloat16, ..."); the reference one does.
            llm_kwargs.setdefault("attention_backend", "CPU_MLA")
    own = {
        "tensor_parallel_size": 1,
        "distributed_executor_backend": "external_launcher",
        "dtype": dtype_name,
        "seed": seed + rank,
        "gpu_memory_utilization": gpu_memory_utilization,
        "max_model_len": max_model_len,
        "enable_sleep_mode": enable_sleep_mode,
        "enforce_eager": enforce_eager,
        # Later turns of an episode and the G samples of a prompt reuse their prompt's KV blocks (not for a
        # model whose layers carry state across positions: platform.prefix_caching).
        "enable_prefix_caching": prefix_caching(config, enable_prefix_caching),
        "logprobs_mode": "processed_logprobs",
        "max_num_batched_tokens": max_num_batched_tokens,
    }
    taken = sorted(set(own) & set(llm_kwargs))
    if taken:
        raise ValueError(f"rollout.engine_kwargs {taken}: rlkit sets these itself (through its own keys)")
    return EngineSettings(
        own | llm_kwargs, enforce_eager, enable_sleep_mode, gpu_memory_utilization, kv_cache_gib
    )
