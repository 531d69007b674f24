"""Packed equals unpacked for every family of the matrix (tests/model_families.py), log-probs and gradients, or
packing is off for the family: the learner's two layouts (`model_inputs`, packed: one sequence with restarting
positions; padded: left-padded prompts) against each row run alone, unpadded (a naive loop that shares no layout
code). Hybrid families carry a recurrent or convolution state from one position to the next; transformers'
kernels for those layers take no row boundaries, so a packed row would start from the previous row's state:
their packed layout is shown to leak (the check below can see a leaking boundary) and `packing` turns it off."""

import logging

import pytest
import torch
from model_families import FAMILIES, HYBRID, family_config

from rlkit.batch import TrainBatch
from rlkit.learner.batching import microbatches, model_inputs, packing
from rlkit.learner.logprobs import score

pytestmark = pytest.mark.slow

PAD = 2
PROMPTS = [[5, 9, 200, 300, 7], [11, 12, 13], [40, 41, 42, 43, 44, 45, 46]]
RESPONSES = [[17, 18, 19, 20], [21, 22, 23, 24, 25, 26], [27, 28]]


def _batch() -> TrainBatch:
    p, t = max(map(len, PROMPTS)), max(map(len, RESPONSES))
    prompt_ids = torch.tensor([[PAD] * (p - len(x)) + x for x in PROMPTS])
    response_ids = torch.tensor([x + [PAD] * (t - len(x)) for x in RESPONSES])
    return TrainBatch(
        prompt_ids=prompt_ids,
        prompt_mask=prompt_ids != PAD,
        response_ids=response_ids,
        response_mask=torch.tensor([[1] * len(x) + [0] * (t - len(x)) for x in RESPONSES]).bool(),
        advantages=torch.zeros(response_ids.shape),
    )


def _model(name):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(family_config(name), dtype=torch.float32).eval()


def _layout(model, packed: bool):
    """[rows, response width] log-probs of the responses in one layout, and the gradient of their sum."""
    (micro,) = microbatches(_batch(), 10_000, packed=packed)
    inp = model_inputs(micro, packed=packed, device="cpu")
    model.zero_grad()
    logp, _ = score(model, model, inp, temperature=1.0, top_k=0, top_p=1.0, chunk_tokens=0, entropy=False)
    mask = _batch().response_mask
    (logp * mask).sum().backward()
    return logp.detach() * mask, {
        n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None
    }


def _alone(model):
    """The same, each row run on its own without padding (the reference)."""
    model.zero_grad()
    width = _batch().response_ids.shape[1]
    rows = []
    for prompt, response in zip(PROMPTS, RESPONSES):
        ids = torch.tensor([prompt + response])
        logp = torch.log_softmax(model(input_ids=ids).logits.float()[0, len(prompt) - 1 : -1], -1)
        logp = logp.gather(-1, torch.tensor(response)[:, None]).squeeze(-1)
        logp.sum().backward()
        rows.append(torch.nn.functional.pad(logp.detach(), (0, width - len(response))))
    return torch.stack(rows), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _grad_rel(got: dict, want: dict) -> float:
    assert got.keys() == want.keys()
    g = torch.cat([got[k].flatten() for k in want])
    w = torch.cat([want[k].flatten() for k in want])
    return float((g - w).norm() / w.norm())


@pytest.mark.parametrize("name", list(FAMILIES))
def test_each_layout_the_learner_uses_equals_each_row_alone(name):
    model = _model(name)
    want_logp, want_grad = _alone(model)
    padded_logp, padded_grad = _layout(model, packed=False)
    assert (padded_logp - want_logp).abs().max() < 1e-5
    assert _grad_rel(padded_grad, want_grad) < 1e-4
    packed_logp, packed_grad = _layout(model, packed=True)
    leak = float((packed_logp - want_logp).abs().max())
    if name in HYBRID:  # a packed row starts from the previous row's state: the check must see it
        assert leak > 1e-4, f"{name}: a packed row no longer sees the previous row's state ({leak:.2g})"
    if leak > 1e-5:  # packing would leak: the learner must not pack this family
        assert packing(True, model) is False, f"{name}: packed rows differ from each row alone by {leak:.2g}"
    else:
        assert _grad_rel(packed_grad, want_grad) < 1e-4
        assert packing(True, model) is True
    assert packing(False, model) is False


@pytest.mark.parametrize(("name", "why"), [("qwen3.5-text", "linear_attention"), ("gpt-oss", "mean |dlogp|")])
def test_turning_packing_off_says_why_once(name, why, caplog):
    model = _model(name)
    with caplog.at_level(logging.INFO, logger="rlkit.learner.batching"):
        assert packing(True, model) is False
        assert packing(False, model) is False
    (record,) = caplog.records
    assert "trainer.pack_sequences=true" in record.message and why in record.message
