"""In-flight weight updates on vLLM's CPU build (trainer.inflight_updates): a push taken between two engine
steps of one generation. Per-token policy versions come from vLLM's weight-version spans; each token's
log-prob is checked against a transformers forward under the weights that really sampled it.

- recompute: running requests re-prefill under the new weights, so every token equals a fresh scoring under
  its own version (prompt + earlier tokens all through that version).
- keep_kv: running requests keep the KV the old weights computed; later tokens come from the hybrid (old
  weights' cache, new weights' compute), rebuilt here with a transformers cache; a request admitted after the
  swap equals a fresh scoring under the new version (its cache salt keeps it off the old prefix blocks).

One tiny Llama (hidden 128, head_dim 32: vLLM's CPU attention needs >= 32) and one tiny Nemotron-H (a Mamba-2
layer's state instead of KV for half the model: recompute must rebuild it under the new weights, keep_kv keeps the
old weights' state as it keeps their KV), one engine per mode and model."""

import pytest
import torch
from vllm_import import TEST_ENGINE, import_vllm

import_vllm()

from rlkit.batch import NO_VERSION  # noqa: E402
from rlkit.models import load_causal_lm, load_tokenizer, make_tiny_checkpoint  # noqa: E402
from rlkit.rollout.engines.base import Sampling  # noqa: E402
from rlkit.weights import iter_full_parameters  # noqa: E402

pytestmark = pytest.mark.slow  # builds a vLLM engine: `make test-fast` leaves it out

T = 10  # tokens per row (ignore_eos: every row runs to the end, so every row spans the swap)
SWAP_AFTER = 4  # engine steps before the push: tokens 0..3 by version 0, 4..9 by version 1
SAMPLING = Sampling(temperature=1.0, max_new_tokens=T, seed=7, ignore_eos=True)


@pytest.fixture(scope="module", params=["llama", "nemotron-h"])
def models(request, tmp_path_factory):
    """A tiny Llama, and a tiny Nemotron-H (a Mamba-2 layer, then attention): its recurrent state is what the old
    weights left in a running request, as the KV is (the engine has no prefix cache for it)."""
    directory = tmp_path_factory.mktemp("inflight")
    if request.param == "llama":
        ckpt = make_tiny_checkpoint(directory, hidden_size=128, num_layers=2, seed=0)
    else:
        from model_families import build_family

        ckpt = build_family(request.param, directory)
    old = load_causal_lm(ckpt).float().eval()
    new = load_causal_lm(ckpt).float().eval()
    torch.manual_seed(3)
    with torch.no_grad():
        for p in new.parameters():
            p.add_(0.05 * torch.randn_like(p))
    tok = load_tokenizer(ckpt)
    prompts = [tok.encode(t) for t in ["Hello there", "The capital of France is"]]
    return ckpt, old, new, prompts


def _engine(ckpt, mode, new):
    """An engine whose `between_steps` pushes `new` as version 1 after SWAP_AFTER steps."""
    from rlkit.rollout.engines.vllm import VLLMEngine

    engine = VLLMEngine(ckpt, dtype="float32", seed=0, kv_cache_gib=0.1, max_model_len=256, **TEST_ENGINE)
    calls = []

    def between_steps():
        calls.append(engine.version)
        if len(calls) == SWAP_AFTER:
            engine.load_weights(iter_full_parameters(new))
            engine.set_version(1, in_flight=True)

    engine.allow_inflight_updates(mode, between_steps)
    return engine, calls


@torch.no_grad()
def _logits(model, ids, past=None, start=0):
    pos = torch.arange(start, start + len(ids))[None]
    out = model(input_ids=torch.tensor([ids]), position_ids=pos, past_key_values=past, use_cache=True)
    return out.logits[0].float(), out.past_key_values


def _fresh(model, prompt, tokens):
    """Log-probs of `tokens` after `prompt`, everything computed by `model` (temperature 1)."""
    logits, _ = _logits(model, prompt + tokens)
    logp = torch.log_softmax(logits[len(prompt) - 1 : -1], -1)
    return logp.gather(-1, torch.tensor(tokens)[:, None]).squeeze(-1)


def _hybrid(old, new, prompt, tokens, k):
    """What keep_kv samples from: the prompt and tokens 0..k-2 were fed (their KV written) under the old
    weights, token k-1 onwards under the new weights attending to that cache. Tokens 0..k-1 were predicted
    by the old weights; token t >= k by the new weights' forward of token t-1."""
    first = _fresh(old, prompt, tokens[:k])
    _, cache = _logits(old, prompt + tokens[: k - 1])
    logits, _ = _logits(new, tokens[k - 1 : -1], past=cache, start=len(prompt) + k - 1)
    later = torch.log_softmax(logits, -1).gather(-1, torch.tensor(tokens[k:])[:, None]).squeeze(-1)
    return torch.cat([first, later])


def _rows(batch, prompts, n):
    for i in range(batch.num_samples):
        length = int(batch.response_lengths[i])
        yield (
            prompts[i // n],
            batch.response_ids[i, :length].tolist(),
            batch.token_versions[i, :length],
            batch.rollout_logprobs[i, :length],
        )


def test_recompute_mode_every_token_equals_its_own_version(models):
    ckpt, old, new, prompts = models
    engine, calls = _engine(ckpt, "recompute", new)
    try:
        batch = engine.generate(prompts, 2, SAMPLING)
        assert calls[: SWAP_AFTER + 1] == [0] * SWAP_AFTER + [1]
        assert batch.response_lengths.tolist() == [T] * 4
        assert (batch.token_versions[~batch.response_mask] == NO_VERSION).all()
        for prompt, tokens, versions, logps in _rows(batch, prompts, 2):
            assert versions.tolist() == [0] * SWAP_AFTER + [1] * (T - SWAP_AFTER)
            want = torch.cat(
                [_fresh(old, prompt, tokens)[:SWAP_AFTER], _fresh(new, prompt, tokens)[SWAP_AFTER:]]
            )
            torch.testing.assert_close(logps, want, atol=1e-5, rtol=0)
            # Negative control: the later tokens are not what the old weights give.
            assert (logps[SWAP_AFTER:] - _fresh(old, prompt, tokens)[SWAP_AFTER:]).abs().max() > 1e-3
        assert batch.oldest_version(-1) == 0
    finally:
        engine.close()


def test_keep_kv_mode_rows_equal_the_hybrid_and_later_requests_the_new_version(models):
    ckpt, old, new, prompts = models
    engine, _ = _engine(ckpt, "keep_kv", new)
    try:
        batch = engine.generate(prompts, 2, SAMPLING)
        for prompt, tokens, versions, logps in _rows(batch, prompts, 2):
            assert versions.tolist() == [0] * SWAP_AFTER + [1] * (T - SWAP_AFTER)
            torch.testing.assert_close(
                logps, _hybrid(old, new, prompt, tokens, SWAP_AFTER), atol=1e-5, rtol=0
            )
            # It is neither version's own scoring: the old weights' KV stayed.
            assert (logps - _fresh(new, prompt, tokens))[SWAP_AFTER:].abs().max() > 1e-3
        # A request admitted after the swap (same prompts, whose old-weight prefix blocks are cached) is all
        # version 1 and equals a fresh scoring under it.
        after = engine.generate(
            prompts, 2, Sampling(temperature=1.0, max_new_tokens=T, seed=9, ignore_eos=True)
        )
        assert (after.token_versions[after.response_mask] == 1).all()
        for prompt, tokens, _, logps in _rows(after, prompts, 2):
            torch.testing.assert_close(logps, _fresh(new, prompt, tokens), atol=1e-5, rtol=0)
    finally:
        engine.close()


def test_an_output_without_weight_version_spans_is_refused_in_flight():
    from types import SimpleNamespace

    from rlkit.rollout.engines.vllm import span_versions

    c = SimpleNamespace(token_ids=[5, 6, 7], weight_versions=None)
    assert span_versions(c, 3, "row") == [3, 3, 3]
    with pytest.raises(ValueError, match="no weight_versions spans"):
        span_versions(c, None, "row")
    span = SimpleNamespace
    c.weight_versions = [span(version="2", start=0, end=1), span(version="3", start=1, end=3)]
    assert span_versions(c, None, "row") == [2, 3, 3]
    c.weight_versions = [span(version="2", start=0, end=2)]
    with pytest.raises(ValueError, match="do not tile"):
        span_versions(c, None, "row")
