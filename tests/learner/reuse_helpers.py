"""Helpers for the reused-forward tests (tests/learner/test_reuse.py and the FSDP2 launch of test_fsdp2.py):
today's separate scoring pass and the update's reused forward on the same learner, and their comparison."""

from __future__ import annotations

import dataclasses

import torch
from learner_helpers import make_batch

from rlkit.algos import correction
from rlkit.learner.reuse import ForwardScores

LOSS = dict(
    dtype="float32", max_grad_norm=None, clip_high=0.28, entropy_coef=0.01, max_tokens_per_microbatch=25
)
LEVELS = ("token", "sequence", "geometric")


def reuse_batches(seed: int = 3):
    """(sampled batch, loss batch): 8 rows; rows 2 and 6 leave the loss (a zero-std group, a cut response)
    but still count in the metrics; rollout log-probs drift from the learner's by ~0.3 per token, so IS
    weights spread around 1 and some exceed `upper`."""
    batch = make_batch(
        n=8, prompt_width=6, response_width=8, seed=seed, prompt_lens=[6, 5, 6, 4, 2, 1, 3, 2],
        response_lens=[8, 7, 8, 6, 2, 1, 3, 1], all_fields=False,
    )  # fmt: skip
    loss_mask = batch.response_mask.clone()
    loss_mask[[2, 6]] = False
    return batch, dataclasses.replace(batch, response_mask=loss_mask)


def rollout_logprobs(learner, batch, seed: int):
    g = torch.Generator().manual_seed(seed)
    lp = learner.forward(batch).logprobs
    return torch.where(batch.response_mask, lp + 0.3 * torch.randn(lp.shape, generator=g), 0.0)


def grads(learner) -> dict[str, torch.Tensor]:
    model = learner.accelerator.unwrap_model(learner.model)
    out = {}
    for n, p in model.named_parameters():
        g = p.grad
        out[n] = (g.full_tensor() if hasattr(g, "full_tensor") else g).detach().clone()
    learner.zero_grad()
    return out


def both_paths(learner, sampled, train, rollout, is_cfg) -> dict:
    """Today's separate pass and the reused forward on the same learner (no optimizer step in between)."""
    kw = dict(level=is_cfg.level, mode=is_cfg.mode, upper=is_cfg.upper)
    mask = sampled.response_mask
    # Separate pass: score every sampled token, IS weights over the whole batch, then the update.
    lp = learner.forward(sampled)
    weights, _, is_metrics = correction.rollout_is(lp.logprobs, rollout, mask, **kw)
    separate = dict(
        logprobs=lp.logprobs, entropy=lp.entropy, weights=weights, is_metrics=is_metrics,
        mismatch=correction.mismatch_metrics(lp.logprobs, rollout, mask),
        metrics=learner.accumulate_gradients(dataclasses.replace(train, is_weights=weights)),
        grads=grads(learner),
    )  # fmt: skip
    # Reused: the update's forward scores; the IS weights come from inside each micro-batch.
    scores = ForwardScores(mask, rollout_logprobs=rollout, is_cfg=is_cfg)
    metrics = learner.accumulate_gradients(
        dataclasses.replace(train, rollout_logprobs=rollout), scores=scores
    )
    weights, _, is_metrics = correction.rollout_is(scores.logprobs, rollout, mask, **kw)
    reused = dict(
        logprobs=scores.logprobs, entropy=scores.entropy, weights=weights, is_metrics=is_metrics,
        mismatch=correction.mismatch_metrics(scores.logprobs, rollout, mask), metrics=metrics,
        grads=grads(learner),
    )  # fmt: skip
    return {"separate": separate, "reused": reused}


def assert_same(result: dict, atol: float = 1e-5) -> None:
    a, b = result["separate"], result["reused"]
    for key in ("logprobs", "entropy", "weights"):
        torch.testing.assert_close(b[key], a[key], atol=atol, rtol=1e-5, msg=key)
    for group in ("is_metrics", "mismatch", "metrics", "grads"):
        assert a[group].keys() == b[group].keys(), group
        for k in a[group]:
            torch.testing.assert_close(b[group][k], a[group][k], atol=atol, rtol=1e-5, msg=f"{group} {k}")
