"""push_weights: the engine ends up with exactly the learner's weights."""

from __future__ import annotations

import pytest
import torch
from cfg_helpers import learner_cfg
from learner_helpers import make_batch

from rlkit.learner import Learner
from rlkit.weights import push_weights


class RecordingEngine:
    """Stands in for a rollout engine: keeps what it was given, consuming the iterator lazily."""

    def __init__(self):
        self.received = {}

    def load_weights(self, named_tensors, *, manifest):
        self.manifest = manifest  # checked before the first tensor arrives
        for name, tensor in named_tensors:
            self.received[name] = tensor.clone()


def test_push_weights_streams_every_tensor_with_stats(tiny_model_dir):
    learner = Learner(learner_cfg(model_path=tiny_model_dir, dtype="float32", lr=1e-2))
    learner.update(make_batch(all_fields=False))
    engine = RecordingEngine()
    stats = push_weights(learner.export(), engine, dtype=torch.bfloat16)

    model = learner.accelerator.unwrap_model(learner.model)
    expected = dict(model.named_parameters())  # tied lm_head appears once, as the embedding
    assert engine.received.keys() == expected.keys()
    assert engine.manifest == {k: tuple(v.shape) for k, v in expected.items()}
    for k, v in expected.items():
        assert engine.received[k].dtype == torch.bfloat16
        assert torch.equal(engine.received[k], v.detach().to(torch.bfloat16)), k
    numel = sum(v.numel() for v in expected.values())
    assert stats["num_tensors"] == len(expected)
    assert stats["num_params"] == numel
    assert stats["bytes"] == 2 * numel
    assert stats["seconds"] > 0


@pytest.fixture(scope="module")
def tokenizer_model_dir(tmp_path_factory):
    """A tiny random Llama sharing SmolLM2's real tokenizer (the HF engine needs one)."""
    from rlkit.models import make_tiny_checkpoint

    return make_tiny_checkpoint(tmp_path_factory.mktemp("tiny_tok"), hidden_size=32, num_layers=2)


def test_push_into_hf_engine_then_engine_and_learner_logprobs_agree(tokenizer_model_dir):
    """DESIGN invariant: right after a push (fp32), engine log-probs equal the learner's (mismatch ~ 0)."""
    from rlkit.models import load_tokenizer
    from rlkit.rollout.engines import hf
    from rlkit.rollout.engines.base import Sampling

    temperature = 0.8
    cfg = learner_cfg(model_path=tokenizer_model_dir, dtype="float32", lr=1e-2, temperature=temperature)
    learner = Learner(cfg)
    tokenizer = load_tokenizer(tokenizer_model_dir)
    engine = hf.HFEngine(tokenizer_model_dir, tokenizer, dtype=torch.float32, device="cpu", seed=0)
    prompts = [tokenizer.encode("What is 2 + 3?"), tokenizer.encode("Name a colour.")]
    sampling = Sampling(temperature=temperature, max_new_tokens=8, seed=0)

    rb = engine.generate(prompts, 2, sampling)
    batch = make_batch(all_fields=False)
    batch = type(batch)(
        prompt_ids=rb.prompt_ids,
        prompt_mask=rb.prompt_mask,
        response_ids=rb.response_ids,
        response_mask=rb.response_mask,
        advantages=torch.randn(rb.response_ids.shape, generator=torch.Generator().manual_seed(0)),
    )
    learner.update(batch)  # the learner's weights move away from the engine's
    before = learner.forward(rb).logprobs
    mask = rb.response_mask
    assert (before - rb.rollout_logprobs)[mask].abs().max() > 1e-3

    push_weights(learner.export(), engine)
    mine = learner.accelerator.unwrap_model(learner.model).state_dict()
    theirs = engine.model.state_dict()
    for k, v in mine.items():
        assert torch.equal(theirs[k], v), k
    rb2 = engine.generate(prompts, 2, sampling)
    scored = learner.forward(rb2).logprobs
    torch.testing.assert_close(
        scored[rb2.response_mask], rb2.rollout_logprobs[rb2.response_mask], atol=1e-4, rtol=0
    )


@pytest.mark.parametrize("truncation", [dict(top_p=0.8), dict(top_k=20)])
def test_truncated_sampling_learner_scores_the_distribution_the_engine_sampled(
    tokenizer_model_dir, truncation
):
    """Under top-p / top-k the engine reports log-probs renormalised over the kept
    tokens; the learner, told the same truncation, replays it and agrees (no false weight-sync
    alarm). Scoring the full distribution instead is off by log(kept mass), the false alarm."""
    from rlkit.algos.correction import mismatch_metrics
    from rlkit.models import load_tokenizer
    from rlkit.rollout.engines import hf
    from rlkit.rollout.engines.base import Sampling

    temperature = 0.8
    tokenizer = load_tokenizer(tokenizer_model_dir)
    engine = hf.HFEngine(tokenizer_model_dir, tokenizer, dtype=torch.float32, device="cpu", seed=0)
    prompts = [tokenizer.encode("What is 2 + 3?"), tokenizer.encode("Name a colour.")]
    rb = engine.generate(
        prompts, 4, Sampling(temperature=temperature, max_new_tokens=12, seed=0, **truncation)
    )
    mask = rb.response_mask

    def scored(**kw):
        cfg = learner_cfg(model_path=tokenizer_model_dir, dtype="float32", temperature=temperature, **kw)
        return Learner(cfg).forward(rb).logprobs

    replayed = scored(**truncation)
    assert torch.isfinite(replayed).all()
    torch.testing.assert_close(replayed[mask], rb.rollout_logprobs[mask], atol=1e-4, rtol=0)
    # The unchunked path replays the same truncation.
    unchunked = scored(logprob_chunk_tokens=0, pack_sequences=False, **truncation)
    torch.testing.assert_close(unchunked[mask], replayed[mask], atol=1e-5, rtol=0)
    # Full-vocabulary scoring: every kept-set log-prob is higher by -log(kept mass) > 0.
    full = scored()
    assert ((rb.rollout_logprobs - full)[mask] > 1e-3).all()
    assert mismatch_metrics(full, rb.rollout_logprobs, mask)["mismatch/kl"] > 0.05


def test_weight_sync_threshold_defaults_by_precision_and_a_configured_value_wins():
    from rlkit.sync import sync_kl_threshold

    # bf16 rounding alone reached |mismatch/kl| 0.036 on the quickstart (docs/benchmarks.md): 0.05 would stop
    # a sound bf16 run by chance; fp32 agrees to ~1e-5, so it keeps the tighter check.
    assert sync_kl_threshold(None, bf16=False) == 0.05
    assert sync_kl_threshold(None, bf16=True) == 0.15
    assert sync_kl_threshold(1e-3, bf16=True) == 1e-3 and sync_kl_threshold(0.3, bf16=False) == 0.3
