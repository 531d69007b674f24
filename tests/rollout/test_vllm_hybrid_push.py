"""A push into a bf16 hybrid engine leaves it computing what a fresh engine with the pushed weights computes.

vLLM's CPU build prepacks a bf16 Mamba-2 mixer's conv weight (on CPUs with AVX512-BF16 or aarch64 bf16) and its
forward reads a view of the weight as first loaded: before rlkit refreshed it after a push
(rlkit/rollout/engines/vllm/reload.py, `_refresh_cpu_conv_views`), a tiny Nemotron-H's pushed engine differed
from a fresh one by 0.1 mean |dlogp|, under the bf16 probe bound (0.25), invisible to the digests (the view is a
non-persistent buffer). The two engines here run the same bf16 weights through the same kernels, so they must
agree to float noise. Qwen3-Next (gated DeltaNet, whose CPU kernel reads the prepacked weight) is checked the same
way."""

import pytest
import torch
from model_families import build_family
from vllm_import import import_vllm

import_vllm()

from rlkit.models import load_causal_lm  # noqa: E402
from rlkit.verify import probe_gap, probe_tokens  # noqa: E402
from rlkit.weights import iter_full_parameters, module_manifest  # noqa: E402

pytestmark = pytest.mark.slow  # builds two vLLM engines


def _bf16_checkpoint(model, directory, tokenizer_from):
    from transformers import AutoTokenizer

    model.to(torch.bfloat16).save_pretrained(directory)
    AutoTokenizer.from_pretrained(tokenizer_from).save_pretrained(directory)
    model.float()
    return str(directory)


@pytest.mark.parametrize("name", ["nemotron-h", "qwen3-next"])
def test_a_pushed_bf16_hybrid_engine_equals_a_fresh_one_with_the_pushed_weights(tmp_path, name):
    from rlkit.rollout.engines.vllm import VLLMEngine

    built = build_family(name, tmp_path / "fp32")
    model = load_causal_lm(built)
    start = _bf16_checkpoint(model, tmp_path / "start", built)  # a hub checkpoint's dtype
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.02 * torch.randn(p.shape, generator=g))
    pushed_ckpt = _bf16_checkpoint(model, tmp_path / "pushed", built)
    tokens = probe_tokens()
    kwargs = dict(dtype="bfloat16", seed=0, kv_cache_gib=0.05, max_model_len=256)
    engine = VLLMEngine(start, **kwargs)
    try:
        before = engine.prompt_logprobs(tokens)
        engine.load_weights(iter_full_parameters(model), manifest=module_manifest(model))
        pushed = engine.prompt_logprobs(tokens)
    finally:
        engine.close()
    fresh_engine = VLLMEngine(pushed_ckpt, **kwargs)
    try:
        fresh = fresh_engine.prompt_logprobs(tokens)
    finally:
        fresh_engine.close()
    assert probe_gap(before, fresh) > 1e-2  # the push changed what the engine computes
    assert probe_gap(pushed, fresh) < 1e-5, probe_gap(pushed, fresh)
