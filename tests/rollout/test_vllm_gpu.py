"""The vLLM engine end to end (CUDA only): exact log-probs, weight push, sleep/wake."""

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


def test_vllm_engine_logprobs_push_and_sleep(tiny_ckpt, tiny_tokenizer):
    pytest.importorskip("vllm", exc_type=ImportError)
    from rlkit.models import load_causal_lm
    from rlkit.rollout.base import Sampling
    from rlkit.rollout.vllm import VLLMEngine

    engine = VLLMEngine(
        tiny_ckpt, dtype="float32", gpu_memory_utilization=0.2, enforce_eager=True, max_model_len=256
    )
    prompts = [tiny_tokenizer(t)["input_ids"] for t in ["Hello there", "1 + 1 ="]]
    s = Sampling(temperature=0.7, max_new_tokens=8, seed=0)

    def recompute(model, b):
        ids = torch.cat([b.prompt_ids, b.response_ids], 1).cuda()
        mask = torch.cat([b.prompt_mask, b.response_mask], 1).long().cuda()
        with torch.no_grad():
            logits = model(
                input_ids=ids, attention_mask=mask, position_ids=(mask.cumsum(-1) - 1).clamp(min=0)
            ).logits
        p = b.prompt_ids.shape[1]
        logp = torch.log_softmax(logits[:, p - 1 : -1].float() / 0.7, -1)
        return (logp.gather(-1, ids[:, p:, None]).squeeze(-1) * mask[:, p:]).cpu()

    batch = engine.generate(prompts, 2, s)
    learner = load_causal_lm(tiny_ckpt, device="cuda")
    torch.testing.assert_close(batch.rollout_logprobs, recompute(learner, batch), atol=1e-3, rtol=0)
    assert torch.equal(batch.response_ids, engine.generate(prompts, 2, s).response_ids)

    torch.manual_seed(0)
    with torch.no_grad():
        for p in learner.parameters():
            p.add_(0.05 * torch.randn_like(p))
    engine.sleep()
    assert engine.load_weights(learner.named_parameters()) == len(list(learner.named_parameters()))
    engine.wake()
    after = engine.generate(prompts, 2, s)
    torch.testing.assert_close(after.rollout_logprobs, recompute(learner, after), atol=1e-3, rtol=0)
    with pytest.raises(RuntimeError, match="updated nothing"):
        engine.load_weights([])
    engine.close()
