"""Which hybrid families (layers with state across positions) rlkit runs on vLLM, decided at start-up from the
config and the model's dtype, before anything loads: what vLLM 0.32's CPU build was measured to run
(tests/rollout/test_families.py builds each), the refusals naming the cause, and the prefix cache turned off for
every such model (vLLM keeps a stateful layer's state with its cached blocks, across weight pushes)."""

import importlib.util
import logging

import pytest
from model_families import build_family, family_config
from vllm_import import import_vllm

import_vllm()

from rlkit.rollout.engines import resolve_engine  # noqa: E402
from rlkit.rollout.engines.vllm.platform import hybrid_refusal, prefix_caching  # noqa: E402

NO_TORCHVISION = importlib.util.find_spec("torchvision") is None


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", None])
def test_nemotron_h_and_attention_models_are_not_refused(dtype):
    for name in ("nemotron-h", "llama3", "qwen3-moe"):
        assert hybrid_refusal(family_config(name), dtype, on_cpu=True) is None, name


def test_gated_deltanet_runs_in_bf16_only_on_the_cpu():
    config = family_config("qwen3-next")
    for dtype in ("float32", "fp32", "float16"):
        why = hybrid_refusal(config, dtype, on_cpu=True)
        assert "gated DeltaNet layers run on vLLM's CPU kernel in bfloat16 only" in why
        assert "use model.dtype=bfloat16" in why
    assert "model.dtype=float32" in hybrid_refusal(config, "float32", on_cpu=True)
    for dtype in ("bfloat16", "bf16", "auto", None):  # auto / None: not known yet, checked again at build
        assert hybrid_refusal(config, dtype, on_cpu=True) is None, dtype
    assert hybrid_refusal(config, "float32", on_cpu=False) is None  # CUDA: vLLM's Triton kernels


def test_gated_deltanet_head_sizes_the_cpu_kernel_does_not_take_are_refused():
    config = family_config("qwen3-next")
    config.linear_key_head_dim = config.linear_value_head_dim = 32
    why = hybrid_refusal(config, "bfloat16", on_cpu=True)
    assert why == (
        "vLLM's CPU gated-DeltaNet kernel takes linear-attention head sizes [64, 128], the model's are [32]"
    )


def test_lfm2_is_refused_on_the_cpu_only_naming_the_rotary_kernel():
    why = hybrid_refusal(family_config("lfm2"), "float32", on_cpu=True)
    assert "RotaryEmbedding.forward_cpu" in why and "5e-2" in why
    assert hybrid_refusal(family_config("lfm2"), "float32", on_cpu=False) is None


@pytest.mark.skipif(not NO_TORCHVISION, reason="torchvision is installed: vLLM's Qwen3.5 module imports")
@pytest.mark.parametrize(
    "name, arch", [("qwen3.5-text", "Qwen3_5ForCausalLM"), ("qwen3.5-moe-text", "Qwen3_5MoeForCausalLM")]
)
def test_qwen3_5_is_refused_where_vllms_module_for_it_does_not_import(name, arch):
    config = family_config(name)
    config.architectures = [arch]  # what save_pretrained writes and vLLM reads
    why = hybrid_refusal(config, "bfloat16", on_cpu=False)  # the import fails on any platform
    assert why.startswith(f"vLLM's module for {arch} (vllm/model_executor/models/qwen3_5.py) does not import")
    assert "No module named 'torchvision'" in why and "another torch" in why


def test_the_prefix_cache_is_off_for_a_stateful_model_and_cannot_be_asked_for(caplog):
    hybrid, dense = family_config("nemotron-h"), family_config("llama3")
    with caplog.at_level(logging.INFO, logger="rlkit.rollout.engines.vllm.platform"):
        assert prefix_caching(hybrid, None) is False
    (line,) = [r.getMessage() for r in caplog.records if "prefix caching" in r.getMessage()]
    assert line.startswith("vLLM prefix caching off: the model's linear_attention layers carry state")
    assert prefix_caching(hybrid, False) is False
    with pytest.raises(ValueError, match=r"rollout.engine_kwargs.enable_prefix_caching=true: the model's"):
        prefix_caching(hybrid, True)
    assert prefix_caching(dense, None) is True and prefix_caching(dense, False) is False


def test_auto_picks_vllm_for_a_hybrid_it_runs_in_the_models_dtype(tmp_path):
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        pytest.skip("the dtype refusal is the CPU kernel's")
    ckpt = build_family("qwen3-next", tmp_path)
    assert resolve_engine("auto", ckpt, dtype="bfloat16", log_pick=False) == "vllm"
    assert resolve_engine("auto", ckpt, dtype="float32", log_pick=False) == "hf"
