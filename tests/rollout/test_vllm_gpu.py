"""vLLM's sleep mode, which only CUDA has (`gpu` marker: skipped without a CUDA device). One engine in this
process: vLLM's CuMem allocator, which sleep mode uses, takes one engine per process."""

from __future__ import annotations

import pytest
import torch
from vllm_import import import_vllm

from rlkit.rollout.engines.base import Sampling

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("level", [1, 2])
def test_sleep_then_push_then_wake_generates_as_before(tmp_path, level):
    """Level 1 offloads the weights and drops the KV cache, level 2 drops both; after the push that follows
    every update, the engine generates what it generated before sleeping (same seed, same weights)."""
    import_vllm()
    from rlkit.models import load_causal_lm, make_tiny_checkpoint
    from rlkit.rollout.engines.vllm import VLLMEngine

    ckpt = make_tiny_checkpoint(tmp_path / "m", hidden_size=128, num_layers=2, seed=0)
    engine = VLLMEngine(ckpt, dtype="float32", seed=0, sleep_level=level, max_model_len=256)
    try:
        assert engine.sleep_enabled
        prompts, s = [[1, 2, 3, 4], [5, 6, 7]], Sampling(temperature=1.0, max_new_tokens=8, seed=3)
        before = engine.generate(prompts, 2, s)
        free = torch.cuda.mem_get_info()[0]
        engine.sleep()
        assert torch.cuda.mem_get_info()[0] > free  # the KV cache (and weights) left the GPU
        model = load_causal_lm(ckpt, dtype=torch.float32, device="cpu")
        engine.load_weights(model.named_parameters(), manifest=engine.manifest)
        after = engine.generate(prompts, 2, s)
        assert torch.equal(after.response_ids, before.response_ids)
        assert torch.allclose(after.rollout_logprobs, before.rollout_logprobs, atol=1e-5)
    finally:
        engine.close()
