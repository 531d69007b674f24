"""The vLLM engine's settings as a pure function (rlkit/rollout/engines/vllm/settings.py): every branch, without
vLLM. Each expected value is the rule the engine's docstring states, written out here."""

import pytest
from transformers import DeepseekV3Config, LlamaConfig, NemotronHConfig

from rlkit.rollout.engines.vllm.memory import COLOCATED_GPU_SHARE
from rlkit.rollout.engines.vllm.settings import engine_settings

LLAMA = LlamaConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=2, max_position_embeddings=8192)


def _settings(config=LLAMA, platform="cpu", **kw):
    base = dict(dtype="float32", seed=3, rank=1, platform=platform, sleep_available=platform == "cuda",
                default_gpu_memory_utilization=0.9)  # fmt: skip
    return engine_settings(config, **{**base, **kw})


def test_cpu_defaults():
    s = _settings()
    k = s.llm_kwargs
    assert s.enforce_eager and not s.enable_sleep_mode and s.kv_cache_gib == 1.0
    assert k["kv_cache_memory_bytes"] == 2**30 and k["enable_chunked_prefill"] is False
    assert k["max_num_batched_tokens"] == 8192  # whole prefills: at least the model's context
    assert k["seed"] == 4 and k["dtype"] == "float32" and k["enable_prefix_caching"] is True
    assert k["distributed_executor_backend"] == "external_launcher" and k["tensor_parallel_size"] == 1
    assert k["logprobs_mode"] == "processed_logprobs" and "attention_backend" not in k
    assert _settings(max_model_len=512).llm_kwargs["max_num_batched_tokens"] == 4096
    assert _settings(enable_chunked_prefill=True).llm_kwargs["enable_chunked_prefill"] is True  # the user's


def test_a_vision_language_config_takes_its_text_models_context():
    from transformers import Idefics3Config

    vl = Idefics3Config(text_config={"model_type": "llama", "max_position_embeddings": 8192})
    assert getattr(vl, "max_position_embeddings", None) is None  # not on the outer config
    assert _settings(vl).llm_kwargs["max_num_batched_tokens"] == 8192  # vLLM's max_model_len: whole prefills


def test_cuda_defaults_colocated_and_alone():
    s = _settings(platform="cuda", dtype="bfloat16")
    assert not s.enforce_eager and s.enable_sleep_mode and s.gpu_memory_utilization == COLOCATED_GPU_SHARE
    assert s.kv_cache_gib is None and "kv_cache_memory_bytes" not in s.llm_kwargs
    assert "enable_chunked_prefill" not in s.llm_kwargs and s.llm_kwargs["max_num_batched_tokens"] == 4096
    alone = _settings(platform="cuda", colocated=False)
    assert alone.gpu_memory_utilization == 0.9 and not alone.enable_sleep_mode


def test_fp32_mla_on_the_cpu_takes_the_reference_backend():
    mla = DeepseekV3Config(hidden_size=64, num_hidden_layers=1, num_attention_heads=2, kv_lora_rank=32)
    assert _settings(mla).llm_kwargs["attention_backend"] == "CPU_MLA"
    assert "attention_backend" not in _settings(mla, dtype="bfloat16").llm_kwargs
    assert "attention_backend" not in _settings(mla, platform="cuda").llm_kwargs


def test_a_stateful_model_gets_no_prefix_cache():
    hybrid = NemotronHConfig(hidden_size=64, num_hidden_layers=2, hybrid_override_pattern="M*")
    assert _settings(hybrid).llm_kwargs["enable_prefix_caching"] is False
    with pytest.raises(ValueError, match="enable_prefix_caching=true"):
        _settings(hybrid, enable_prefix_caching=True)


def test_routing_replay_asks_for_the_routes():
    assert _settings(routing_replay=True).llm_kwargs["enable_return_routed_experts"] is True
    assert "enable_return_routed_experts" not in _settings().llm_kwargs


@pytest.mark.parametrize(
    "kw, message",
    [
        ({"sleep_level": 3}, "sleep_level=3"),
        ({"kv_cache_gib": 0}, "kv_cache_gib=0"),
        ({"gpu_memory_utilization": 1.5}, "gpu_memory_utilization=1.5"),
        ({"enable_sleep_mode": True}, "no sleep mode on its cpu platform"),
        ({"seed": 1, "dtype": "float32", "enforce_eager": True, "logprobs_mode": "raw"}, "logprobs_mode"),
    ],
)
def test_bad_values_are_named(kw, message):
    with pytest.raises(ValueError, match=message):
        _settings(**kw)
