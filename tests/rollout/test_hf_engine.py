"""HF engine: log-probs equal a learner-style recomputation, sampling semantics, weight push, bad input."""

import pytest
import torch

from rlkit.models import load_causal_lm, load_tokenizer, make_tiny_checkpoint
from rlkit.rollout.engines.base import Sampling
from rlkit.rollout.engines.hf import HFEngine, sample_rows

pytestmark = pytest.mark.slow  # generates with a model for seconds: `make test-fast` leaves it out

EOS = 2  # SmolLM2's <|im_end|>, also its pad token


def response_logits(model, batch) -> torch.Tensor:
    """What a learner does: one forward over prompt+response; [N, T, V] logits predicting each
    response token (token t sits at p + t and is predicted by the logits at p + t - 1)."""
    ids = torch.cat([batch.prompt_ids, batch.response_ids], 1)
    mask = torch.cat([batch.prompt_mask, batch.response_mask], 1).long()
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=mask, position_ids=positions).logits
    p = batch.prompt_ids.shape[1]
    return logits[:, p - 1 : -1].float()


def recompute_logprobs(model, batch, temperature: float) -> torch.Tensor:
    """log_softmax(logits / T) gathered at the sampled tokens, 0 at padding."""
    logp = torch.log_softmax(response_logits(model, batch) / temperature, -1)
    return logp.gather(-1, batch.response_ids[..., None]).squeeze(-1) * batch.response_mask


def prompts_of(tokenizer, texts):
    return [tokenizer(t)["input_ids"] for t in texts]


@pytest.fixture(scope="module")
def tiny_model(tiny_ckpt):
    return load_causal_lm(tiny_ckpt)


@pytest.fixture(scope="module")
def engine(tiny_ckpt):
    return HFEngine(tiny_ckpt, seed=0)


@pytest.fixture(scope="module")
def prompts(tiny_tokenizer):
    # Different lengths, so left padding is exercised.
    return prompts_of(tiny_tokenizer, ["Hello there", "What is the capital of France? Answer:", "1 + 1 ="])


def eos_biased_model(tiny_ckpt, token_id: int, bias: float):
    """The tiny model with an lm_head bias that makes `token_id` likely, to force stops."""
    model = load_causal_lm(tiny_ckpt)
    head = torch.nn.Linear(model.config.hidden_size, model.config.vocab_size, bias=True)
    with torch.no_grad():
        head.weight.copy_(model.lm_head.weight)
        head.bias.zero_()
        head.bias[token_id] = bias
    model.lm_head = head
    model.config.tie_word_embeddings = False
    return model


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_logprobs_equal_learner_recomputation(engine, tiny_model, prompts, temperature):
    batch = engine.generate(prompts, 2, Sampling(temperature=temperature, max_new_tokens=12, seed=3))
    expected = recompute_logprobs(tiny_model, batch, temperature)
    assert batch.rollout_logprobs.dtype == torch.float32
    torch.testing.assert_close(batch.rollout_logprobs, expected, atol=1e-4, rtol=0)
    assert (batch.rollout_logprobs[~batch.response_mask] == 0).all()
    assert (batch.rollout_logprobs[batch.response_mask] < 0).all()


def test_top_k_top_p_logprobs_are_the_renormalised_truncated_distribution(engine, tiny_model, prompts):
    sampling = Sampling(temperature=0.7, top_k=20, top_p=0.5, max_new_tokens=8, seed=5)
    batch = engine.generate(prompts, 2, sampling)
    logits = response_logits(tiny_model, batch)
    # Naive per-token loop: keep the top 20, then the smallest head of them whose mass reaches 0.5.
    for i in range(batch.num_samples):
        for t in range(int(batch.response_mask[i].sum())):
            probs = torch.softmax(logits[i, t] / 0.7, -1)
            top = probs.topk(20)
            kept_p = top.values / top.values.sum()
            keep, mass = [], 0.0
            for j in range(20):
                keep.append(j)
                mass += float(kept_p[j])
                if mass >= 0.5:
                    break
            kept_ids = top.indices[keep].tolist()
            tok = int(batch.response_ids[i, t])
            assert tok in kept_ids, "sampled a token outside the truncated set"
            expected = torch.log(kept_p[keep[kept_ids.index(tok)]] / kept_p[keep].sum())
            assert abs(float(batch.rollout_logprobs[i, t]) - float(expected)) < 1e-4


def test_sampling_draws_each_token_at_its_probability_and_never_a_zero_one():
    """The engine's draw (inverse transform on the row's cumulative sum) against the probabilities themselves:
    200,000 draws of two rows (one with entries cut to zero, as top-k leaves them, at both ends and inside)
    give every token within 5 binomial standard deviations of its probability, and no zero-probability token."""
    probs = torch.tensor(
        [[0.0, 0.1, 0.0, 0.25, 0.05, 0.6, 0.0], [0.5, 0.0, 0.0, 0.0, 0.0, 0.0, 0.5]], dtype=torch.float32
    )
    n = 100_000
    draws = sample_rows(probs.repeat_interleave(n, 0), torch.Generator().manual_seed(0)).view(2, n)
    for row, want in zip(draws, probs):
        counts = torch.bincount(row, minlength=probs.shape[1]).double()
        assert counts[want == 0].sum() == 0
        sigma = (n * want * (1 - want)).double().sqrt()
        assert ((counts - n * want.double()).abs() <= 5 * sigma + 1e-9).all(), (counts / n, want)
    # Reproducible from the generator's seed, and different for another seed.
    a = sample_rows(probs.repeat(50, 1), torch.Generator().manual_seed(1))
    assert torch.equal(a, sample_rows(probs.repeat(50, 1), torch.Generator().manual_seed(1)))
    assert not torch.equal(a, sample_rows(probs.repeat(50, 1), torch.Generator().manual_seed(2)))


def test_greedy_is_deterministic_and_is_the_argmax(engine, tiny_model, prompts):
    greedy = Sampling(temperature=0, max_new_tokens=10)
    a = engine.generate(prompts, 2, greedy)
    b = engine.generate(prompts, 2, greedy)
    assert torch.equal(a.response_ids, b.response_ids)
    assert torch.equal(a.rollout_logprobs, b.rollout_logprobs)
    argmax = response_logits(tiny_model, a).argmax(-1)
    assert torch.equal(argmax[a.response_mask], a.response_ids[a.response_mask])
    # Greedy reports the temperature-1 log-probs (as vLLM does).
    torch.testing.assert_close(a.rollout_logprobs, recompute_logprobs(tiny_model, a, 1.0), atol=1e-4, rtol=0)


def test_a_prompt_samples_the_same_alone_or_padded_in_a_batch(engine, prompts):
    greedy = Sampling(temperature=0, max_new_tokens=8)
    together = engine.generate(prompts, 1, greedy)
    for i, p in enumerate(prompts):
        alone = engine.generate([p], 1, greedy)
        n = int(alone.response_mask.sum())
        assert torch.equal(together.response_ids[i, :n], alone.response_ids[0, :n])
        torch.testing.assert_close(
            together.rollout_logprobs[i, :n], alone.rollout_logprobs[0, :n], atol=1e-5, rtol=0
        )


def test_seeded_and_reproducible(tiny_ckpt, engine, prompts):
    s = Sampling(temperature=1.0, max_new_tokens=8, seed=11)
    a, b = engine.generate(prompts, 2, s), engine.generate(prompts, 2, s)
    assert torch.equal(a.response_ids, b.response_ids)
    other = engine.generate(prompts, 2, Sampling(temperature=1.0, max_new_tokens=8, seed=12))
    assert not torch.equal(a.response_ids, other.response_ids)
    # Without a per-call seed, the engine's own seeded generator runs on: fresh engines agree.
    unseeded = Sampling(temperature=1.0, max_new_tokens=8)
    e1, e2 = HFEngine(tiny_ckpt, seed=7), HFEngine(tiny_ckpt, seed=7)
    first = e1.generate(prompts, 2, unseeded)
    assert torch.equal(first.response_ids, e2.generate(prompts, 2, unseeded).response_ids)
    assert not torch.equal(first.response_ids, e1.generate(prompts, 2, unseeded).response_ids)


def test_n_samples_per_prompt_are_contiguous(engine, prompts):
    n = 3
    batch = engine.generate(prompts, n, Sampling(temperature=1.0, max_new_tokens=6, seed=0))
    assert batch.num_samples == len(prompts) * n and batch.group_size == n
    assert batch.group_index.tolist() == [i // n for i in range(len(prompts) * n)]
    for row in range(batch.num_samples):
        prompt = prompts[row // n]
        assert batch.prompt_ids[row][batch.prompt_mask[row]].tolist() == prompt
        assert batch.prompt_mask[row].tolist() == [False] * (batch.prompt_ids.shape[1] - len(prompt)) + [
            True
        ] * len(prompt)
    # Samples of a group are distinct draws, not copies.
    assert len({tuple(r.tolist()) for r in batch.response_ids[:n]}) > 1
    assert len(batch.response_texts) == batch.num_samples


def test_finish_reasons_and_masks_cover_exactly_up_to_eos(tiny_ckpt, tiny_tokenizer, prompts):
    model = eos_biased_model(tiny_ckpt, EOS, bias=10.0)  # p(EOS) ~ 0.3 per token over a 49k vocabulary
    engine = HFEngine(model, tiny_tokenizer, seed=0)
    max_new = 6
    batch = engine.generate(prompts, 8, Sampling(temperature=1.0, max_new_tokens=max_new, seed=1))
    assert set(batch.finish_reasons) == {"stop", "length"}, "bias should give both outcomes"
    for i, reason in enumerate(batch.finish_reasons):
        toks = batch.response_ids[i].tolist()
        mask = batch.response_mask[i].tolist()
        length = sum(mask)
        assert mask == [True] * length + [False] * (len(mask) - length)
        generated = toks[:length]
        if reason == "stop":
            assert generated[-1] == EOS and EOS not in generated[:-1]
        else:
            assert length == max_new and EOS not in generated
    assert batch.response_ids.shape[1] == max(batch.response_lengths.tolist())
    # Log-probs stay exact with early-stopped rows in the batch.
    torch.testing.assert_close(
        batch.rollout_logprobs, recompute_logprobs(engine.model, batch, 1.0), atol=1e-4, rtol=0
    )
    stats = batch.stats
    assert stats["gen_tokens"] == batch.response_mask.sum().item()
    assert stats["gen_tokens_per_s"] == pytest.approx(stats["gen_tokens"] / stats["gen_seconds"])


def test_ignore_eos_generates_exactly_max_new_tokens(tiny_ckpt, tiny_tokenizer, prompts):
    """The fixed-length mode of throughput benchmarks, against a negative control: the same EOS-prone model
    and seed stop early without it, and a stop string that would end every row is ignored with it."""
    model = eos_biased_model(tiny_ckpt, EOS, bias=10.0)  # p(EOS) ~ 0.3 per token
    engine = HFEngine(model, tiny_tokenizer, seed=0)
    max_new = 6
    free = engine.generate(prompts, 4, Sampling(temperature=1.0, max_new_tokens=max_new, seed=1))
    assert "stop" in free.finish_reasons and min(free.response_lengths.tolist()) < max_new
    for stop in ((), ("e", " ")):
        s = Sampling(temperature=1.0, max_new_tokens=max_new, stop=stop, seed=1, ignore_eos=True)
        batch = engine.generate(prompts, 4, s)
        assert batch.response_lengths.tolist() == [max_new] * 12
        assert set(batch.finish_reasons) == {"length"}
        assert (batch.response_ids == EOS).any(), "EOS was sampled and generation went on past it"
        assert batch.stats["gen_tokens"] == 12 * max_new
    # Still the exact sampling distribution's log-probs, EOS tokens mid-response included.
    torch.testing.assert_close(
        batch.rollout_logprobs, recompute_logprobs(engine.model, batch, 1.0), atol=1e-4, rtol=0
    )


def test_stop_strings_end_the_response_with_the_stop_string(tiny_ckpt, tiny_tokenizer, prompts):
    target = tiny_tokenizer(" the")["input_ids"]
    assert len(target) == 1
    model = eos_biased_model(tiny_ckpt, target[0], bias=9.0)
    engine = HFEngine(model, tiny_tokenizer, seed=0)
    batch = engine.generate(prompts, 4, Sampling(temperature=1.0, max_new_tokens=8, stop=("the",), seed=2))
    by_string = 0
    for i, reason in enumerate(batch.finish_reasons):
        generated = batch.response_ids[i][batch.response_mask[i]].tolist()
        text = tiny_tokenizer.decode(generated)
        if reason == "stop" and generated[-1] != EOS:
            # The newest token completed the stop string, which stays in the response.
            assert "the" in text and "the" not in tiny_tokenizer.decode(generated[:-1])
            by_string += 1
        if reason == "length":
            assert "the" not in text and len(generated) == 8
    assert by_string > 0, "the bias should make some rows stop on the stop string"


def test_generation_ends_at_the_context(tmp_path_factory, tiny_tokenizer):
    ckpt = make_tiny_checkpoint(tmp_path_factory.mktemp("short"), max_position_embeddings=32)
    engine = HFEngine(ckpt, seed=0)
    batch = engine.generate([[5] * 28, [5] * 10], 1, Sampling(temperature=0, max_new_tokens=10))
    assert batch.response_lengths.tolist()[0] == 4 and batch.finish_reasons[0] == "length"
    with pytest.raises(ValueError, match=r"prompts\[1\] has 32 tokens.*context is 32"):
        engine.generate([[5] * 3, [5] * 32], 1, Sampling())


def test_bad_input_raises_clear_errors(engine, prompts):
    s = Sampling(max_new_tokens=4)
    with pytest.raises(ValueError, match="prompts is empty"):
        engine.generate([], 1, s)
    for bad_n in (0, -1):
        with pytest.raises(ValueError, match=f"n={bad_n}"):
            engine.generate(prompts, bad_n, s)
    with pytest.raises(ValueError, match=r"prompts\[1\] is empty"):
        engine.generate([[5], []], 1, s)
    with pytest.raises(ValueError, match=r"prompts\[0\] has token ids outside"):
        engine.generate([[10**9]], 1, s)
    with pytest.raises(ValueError, match="max_new_tokens=0"):
        Sampling(max_new_tokens=0)


def test_weight_push_makes_the_engine_sample_from_the_new_weights(tiny_ckpt, prompts):
    engine = HFEngine(tiny_ckpt, seed=0)
    learner = load_causal_lm(tiny_ckpt)
    torch.manual_seed(0)
    with torch.no_grad():
        for p in learner.parameters():
            p.add_(0.05 * torch.randn_like(p))
    s = Sampling(temperature=1.0, max_new_tokens=8, seed=4)
    before = engine.generate(prompts, 2, s)
    assert (before.rollout_logprobs - recompute_logprobs(learner, before, 1.0)).abs().max() > 1e-2
    count = engine.load_weights(learner.named_parameters())
    assert count == len(list(learner.named_parameters()))
    after = engine.generate(prompts, 2, s)
    torch.testing.assert_close(
        after.rollout_logprobs, recompute_logprobs(learner, after, 1.0), atol=1e-4, rtol=0
    )
    # The engine holds its own copy: later learner changes do not leak in without a push.
    with torch.no_grad():
        learner.model.norm.weight.mul_(2)
    assert not torch.equal(engine.model.model.norm.weight, learner.model.norm.weight)


def test_weight_push_rejects_empty_unknown_and_misshaped(engine, tiny_model):
    with pytest.raises(RuntimeError, match="updated nothing"):
        engine.load_weights([])
    with pytest.raises(KeyError, match="model.nope.weight"):
        engine.load_weights([("model.nope.weight", torch.zeros(1))])
    with pytest.raises(ValueError, match=r"model.norm.weight.*\(3,\)"):
        engine.load_weights([("model.norm.weight", torch.zeros(3))])
    # A manifest that does not fit is refused before anything is copied.
    manifest = {n: tuple(p.shape) for n, p in tiny_model.named_parameters()}
    with pytest.raises(ValueError, match=r"refused before copying.*model.norm.weight: pushed \(3,\)"):
        engine.load_weights(tiny_model.named_parameters(), manifest={**manifest, "model.norm.weight": (3,)})
    # A push that stops midway leaves an engine that refuses to generate until a complete push.
    with pytest.raises(ValueError, match="ended before"):
        engine.load_weights(list(tiny_model.named_parameters())[:2], manifest=manifest)
    with pytest.raises(RuntimeError, match="refuses to generate.*failed midway"):
        engine.generate([[1, 2]], 1, Sampling(max_new_tokens=2, seed=0))
    assert engine.load_weights(tiny_model.named_parameters(), manifest=manifest) == len(manifest)
    assert engine.generate([[1, 2]], 1, Sampling(max_new_tokens=2, seed=0)).response_mask.any()


def test_engine_without_pad_token_pads_with_eos(tiny_ckpt, caplog):
    tok = load_tokenizer(tiny_ckpt)
    tok.pad_token = None
    assert tok.pad_token_id is None
    engine = HFEngine(load_causal_lm(tiny_ckpt), tok, seed=0)
    assert "no pad token" in caplog.text
    batch = engine.generate([[5, 6, 7], [8]], 1, Sampling(temperature=0, max_new_tokens=3))
    assert batch.prompt_ids[1, 0].item() == tok.eos_token_id


def test_real_smollm2_chat_logprobs():
    """The embedded SmolLM2-135M-Instruct: chat template in, exact log-probs out."""
    tok = load_tokenizer("smollm2-135m")
    engine = HFEngine("smollm2-135m", seed=0)
    chats = [[{"role": "user", "content": "What is 2+2?"}], [{"role": "user", "content": "Name a color."}]]
    prompts = [tok.apply_chat_template(c, add_generation_prompt=True)["input_ids"] for c in chats]
    assert tok.decode(prompts[0]).endswith("<|im_start|>assistant\n")
    batch = engine.generate(prompts, 1, Sampling(temperature=0.7, max_new_tokens=16, seed=0))
    torch.testing.assert_close(
        batch.rollout_logprobs, recompute_logprobs(engine.model, batch, 0.7), atol=1e-4, rtol=0
    )
    assert all(len(t) > 0 for t in batch.response_texts)
    assert batch.stats["gen_tokens_per_s"] > 0
