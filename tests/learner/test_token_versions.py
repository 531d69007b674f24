"""Per-token policy versions in the learner (in-flight weight updates: one row holds tokens of several
versions): the decoupled-PPO gradient of a two-version batch equals a naive per-token loop, tokens older than
`algo.max_token_staleness` leave the loss, and token versions travel through micro-batches and padding
micro-batches like every per-token field."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from cfg_helpers import learner_cfg
from learner_helpers import assert_grads_close, learner_grads, load_fp32, make_batch

from rlkit.algos import correction, staleness
from rlkit.batch import NO_VERSION
from rlkit.learner import Learner
from rlkit.learner.batching import microbatches, padding_micro

CURRENT = 2  # the step being trained; tokens come from versions 0 and 1
UPPER = 2.0  # rollout IS truncation


def _versions(batch, switch: list[int]) -> torch.Tensor:
    """Row i: tokens before switch[i] by version 0, the rest by version 1; NO_VERSION off the mask."""
    cols = torch.arange(batch.response_ids.shape[1])[None]
    v = torch.where(cols < torch.tensor(switch)[:, None], 0, 1)
    return torch.where(batch.response_mask, v, NO_VERSION)


def _perturbed(path: str, seed: int):
    model = load_fp32(path)
    torch.manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    return model


def _token_logp(model, prompt, resp, t):
    """log p(resp[t] | prompt, resp[:t]) under `model`: one forward for this one token (the naive loop)."""
    ids = torch.cat([prompt, resp[:t]])[None]
    return torch.log_softmax(model(input_ids=ids).logits[0, -1].float(), -1)[resp[t]]


@pytest.mark.parametrize("max_token_staleness", [None, 1])
def test_two_version_batch_is_weights_and_gradient_equal_a_naive_decoupled_ppo_loop(
    tiny_model_dir, max_token_staleness
):
    """Behaviour = the version that sampled each token (v0 before a row's switch, v1 after); proximal = the
    learner's weights (version 2). Production path: learner forward -> correction.rollout_is (token level,
    truncated at 2) -> staleness.fresh_tokens -> learner.accumulate_gradients. Reference: a loop over every
    token, one forward per token for its behaviour log-prob (under its own version's model) and for its
    current log-prob, loss = token mean of -A * min(exp(prox - behaviour), 2) * exp(logp - prox)."""
    v0, v1 = _perturbed(tiny_model_dir, 1), _perturbed(tiny_model_dir, 2)
    batch = make_batch(n=4, seed=5, all_fields=False, response_lens=[6, 9, 3, 7])
    switch = [2, 5, 3, 0]  # row 2 all version 0, row 3 all version 1, rows 0-1 mixed
    versions = _versions(batch, switch)
    g = torch.Generator().manual_seed(0)
    adv = torch.randn(4, 1, generator=g).expand_as(batch.advantages).clone()

    # Behaviour log-probs as the samplers computed them: each version over the whole batch, then per token.
    def batch_logp(model):
        with torch.no_grad():
            rows = []
            for i in range(4):
                prompt, resp = batch.prompt_ids[i][batch.prompt_mask[i]], batch.response_ids[i]
                logits = model(input_ids=torch.cat([prompt, resp])[None]).logits[0, len(prompt) - 1 : -1]
                rows.append(torch.log_softmax(logits.float(), -1).gather(-1, resp[:, None])[:, 0])
            return torch.stack(rows)

    behaviour = torch.where(versions == 0, batch_logp(v0), batch_logp(v1))
    behaviour = torch.where(batch.response_mask, behaviour, 0.0)

    learner = Learner(
        learner_cfg(model_path=tiny_model_dir, dtype="float32", lr=1e-3, max_grad_norm=None, seed=0)
    )
    prox = learner.forward(batch).logprobs
    mask = batch.response_mask
    w, kept, _ = correction.rollout_is(prox, behaviour, mask, level="token", mode="truncate", upper=UPPER)
    loss_mask = staleness.fresh_tokens(versions, mask & kept, CURRENT, max_token_staleness)
    train = dataclasses.replace(
        batch, advantages=adv, is_weights=w, response_mask=loss_mask, token_versions=versions
    )
    learner.zero_grad()
    learner.accumulate_gradients(train)
    got = learner_grads(learner)

    ref = load_fp32(tiny_model_dir)
    terms, count = [], 0
    for i in range(4):
        prompt, resp = (
            batch.prompt_ids[i][batch.prompt_mask[i]],
            batch.response_ids[i][batch.response_mask[i]],
        )
        for t in range(len(resp)):
            sampler = v0 if t < switch[i] else v1
            age = CURRENT - (0 if t < switch[i] else 1)
            with torch.no_grad():
                beh = _token_logp(sampler, prompt, resp, t)
            logp = _token_logp(ref, prompt, resp, t)
            weight = torch.exp(logp.detach() - beh).clamp(max=UPPER)
            torch.testing.assert_close(w[i, t], weight, atol=1e-5, rtol=1e-5)
            if max_token_staleness is not None and age > max_token_staleness:
                assert not loss_mask[i, t]
                continue
            assert loss_mask[i, t]
            terms.append(-adv[i, t] * weight * torch.exp(logp - logp.detach()))
            count += 1
    assert count == (int(mask.sum()) if max_token_staleness is None else int((versions == 1).sum()))
    (torch.stack(terms).sum() / count).backward()
    expected = {n: p.grad for n, p in ref.named_parameters()}
    assert_grads_close(got, expected)
    # The batch really is off-policy and each version matters.
    assert (w - 1).abs()[mask].max() > 1e-3


def test_token_versions_travel_through_microbatches_and_padding():
    batch = make_batch(n=7, seed=2)
    versions = _versions(batch, [0, 1, 2, 3, 4, 5, 6])
    batch = dataclasses.replace(batch, token_versions=versions)
    micros = microbatches(batch, max_tokens=24)
    assert len(micros) > 1
    seen = []
    for m in micros:
        assert torch.equal(m.batch.token_versions, versions[m.rows])
        seen += m.rows.tolist()
    assert sorted(seen) == list(range(7))
    pad = padding_micro(batch)
    assert pad.batch.token_versions.shape == (1, versions.shape[1]) and not pad.batch.response_mask.any()
