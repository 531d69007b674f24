"""Packing with images, for every VL family of tests/vl_families.py: the learner's packed layout (`model_inputs`
packed: the rows one after the other in one sequence, their pictures' tensors in row order; Qwen's 3D positions
computed per row, `rlkit.learner.positions`) gives each row's log-probs, and the gradient of their sum with respect
to every parameter (vision tower included), as each row run alone through plain transformers on what the
processor makes of its prompt (vl_families.logprobs_alone: no rlkit layout code). Rows of different picture sizes
and counts and one row without a picture. Qwen3.5's gated-DeltaNet layers carry state across the row boundary:
its packed layout is shown to leak and `packing` keeps it off, naming the family."""

from __future__ import annotations

import logging

import pytest
import torch
from vl_families import build_vl_family, family_params, logprobs_alone, picture

from rlkit.batch import TrainBatch
from rlkit.config.schema import DataConfig
from rlkit.data.prompts import build_prompts
from rlkit.learner.batching import microbatches, model_inputs, packing
from rlkit.learner.logprobs import score
from rlkit.models import load_causal_lm, stateful_layers
from rlkit.vision import load_processor

RESPONSES = [[17, 18, 19, 20, 21], [22, 23, 24], [25, 26, 27, 28, 29, 30], [31, 32, 33, 34]]


@pytest.fixture(scope="module", params=family_params())
def vl(request, tmp_path_factory):
    name = request.param
    path = build_vl_family(name, tmp_path_factory.mktemp(name))
    processor = load_processor(path)
    cfg = DataConfig(path="/nonexistent", image_key="image", prompt_key="q", answer_key="a", instruction="")
    rows = [
        {"q": "Colour?", "a": "r", "image": picture((255, 0, 0))},
        {"q": "No picture, text only, and a longer question.", "a": "z", "image": None},
        {"q": "<image> and <image>: which?", "a": "y", "image": [picture(seed=2), picture((0, 0, 255))]},
        {"q": "A wide one?", "a": "x", "image": picture(seed=1, size=(112, 56))},
    ]  # fmt: skip
    prompts = build_prompts(rows, processor.tokenizer, cfg, processor=processor)
    torch.manual_seed(0)
    model = load_causal_lm(path, vision=True, dtype=torch.float32, device="cpu").eval()
    return name, model, processor, prompts


def _batch(prompts) -> TrainBatch:
    n, width, t = len(prompts), max(map(len, prompts.token_ids)), max(map(len, RESPONSES))
    prompt_ids = torch.zeros(n, width, dtype=torch.long)
    prompt_mask = torch.zeros(n, width, dtype=torch.bool)
    for i, p in enumerate(prompts.token_ids):
        prompt_ids[i, width - len(p) :] = torch.tensor(p)
        prompt_mask[i, width - len(p) :] = True
    response_ids = torch.tensor([r + [0] * (t - len(r)) for r in RESPONSES])
    response_mask = torch.tensor([[1] * len(r) + [0] * (t - len(r)) for r in RESPONSES]).bool()
    return TrainBatch(
        prompt_ids, prompt_mask, response_ids, response_mask, advantages=torch.zeros(n, t),
        images=tuple(prompts.images),
    )  # fmt: skip


def _grads(model) -> dict:
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _layout(model, prompts, *, packed: bool):
    """Log-probs [rows, width] of one layout (a single micro-batch) and the gradient of their sum."""
    batch = _batch(prompts)
    (micro,) = microbatches(batch, 10_000, packed=packed)
    inp = model_inputs(micro, packed=packed, device="cpu")
    assert (inp.input_ids.shape[0] == 1) == packed
    model.zero_grad()
    logp, _ = score(model, model, inp, temperature=1.0, top_k=0, top_p=1.0, chunk_tokens=0, entropy=False)
    (logp * batch.response_mask).sum().backward()
    return logp.detach() * batch.response_mask, _grads(model)


def _alone(model, processor, prompts):
    """The reference: each row alone through plain transformers (vl_families.logprobs_alone)."""
    model.zero_grad()
    width = max(map(len, RESPONSES))
    rows = []
    for text, images, response in zip(prompts.texts, prompts.images, RESPONSES):
        pictures = images.pictures if images is not None else ()
        logp = logprobs_alone(model, processor, text, pictures, response, grad=True)
        logp.sum().backward()
        rows.append(torch.nn.functional.pad(logp.detach(), (0, width - len(response))))
    return torch.stack(rows), _grads(model)


def _rel(got: dict, want: dict) -> float:
    assert got.keys() == want.keys()
    g = torch.cat([got[k].flatten() for k in want])
    w = torch.cat([want[k].flatten() for k in want])
    return float((g - w).norm() / w.norm())


def test_packed_with_images_equals_each_row_alone(vl, caplog):
    name, model, processor, prompts = vl
    assert sum(x is not None for x in prompts.images) == 3 and prompts.images[1] is None
    want_logp, want_grad = _alone(model, processor, prompts)
    assert any("vision" in n or "visual" in n for n in want_grad)  # the pictures' tower is in the gradient
    padded_logp, padded_grad = _layout(model, prompts, packed=False)
    assert (padded_logp - want_logp).abs().max() < 1e-5
    assert _rel(padded_grad, want_grad) < 1e-5
    packed_logp, packed_grad = _layout(model, prompts, packed=True)
    leak = float((packed_logp - want_logp).abs().max())
    with caplog.at_level(logging.INFO, logger="rlkit.learner.batching"):
        on = packing(True, model)
    if stateful_layers(model.config):  # Qwen3.5: a packed row starts from the previous row's state
        assert leak > 1e-4, f"{name}: a packed row no longer sees the previous row's state ({leak:.2g})"
        assert not on
        assert f"packing is off for this model ({model.config.model_type})" in caplog.text
        assert "linear_attention layers carry state" in caplog.text
        return
    assert leak < 1e-5, f"{name}: packed rows with images differ from each row alone by {leak:.2g}"
    assert _rel(packed_grad, want_grad) < 1e-5
    assert on and not caplog.text
