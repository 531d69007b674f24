"""The HF engine generates with images (a tiny Qwen2.5-VL, tests/vl_families.py): the log-prob of every sampled
token equals the model's own on the row alone (unpadded, the processor's outputs, the model computing its 3D
positions), whatever the left padding of the batch; the batch's rows carry their prompt's Images."""

from __future__ import annotations

import pytest
import torch
from vl_families import VL_FAMILIES, build_vl_family, picture

from rlkit.config.schema import DataConfig
from rlkit.data.prompts import build_prompts
from rlkit.models import load_causal_lm, load_processor
from rlkit.rollout.engines.base import Sampling
from rlkit.rollout.engines.hf import HFEngine


@pytest.fixture(scope="module", params=sorted(VL_FAMILIES))
def vl(request, tmp_path_factory):
    path = build_vl_family(request.param, tmp_path_factory.mktemp(request.param))
    processor = load_processor(path)
    cfg = DataConfig(path="/nonexistent", image_key="image", prompt_key="q", answer_key="a", instruction="")
    rows = [
        {"q": "Colour?", "a": "red", "image": picture((255, 0, 0))},
        {
            "q": "Which of the two pictures is brighter, and why?",
            "a": "x",
            "image": picture(seed=3, size=(112, 56)),
        },
        {"q": "No picture here, a longer question about nothing at all?", "a": "y", "image": None},
    ]
    return path, processor, build_prompts(rows, processor.tokenizer, cfg, processor=processor)


def alone(model, prompt: list[int], response: list[int], images) -> torch.Tensor:
    """The naive reference: the model on the one row, unpadded, with its processor tensors."""
    ids = torch.tensor([prompt + response])
    kw = {}
    if images is not None:
        kw = dict(images.tensors)
        kw["mm_token_type_ids"] = (ids == model.config.image_token_id).int()
    with torch.no_grad():
        logits = model(input_ids=ids, **kw).logits.float()
    logp = torch.log_softmax(logits[0, :-1], -1).gather(-1, ids[0, 1:, None]).squeeze(-1)
    return logp[len(prompt) - 1 :]


def test_hf_engine_samples_with_images_as_the_model_scores_them(vl):
    path, processor, ps = vl
    assert ps.images[2] is None and ps.images[0] is not None
    engine = HFEngine(path, processor.tokenizer, vision=True)
    rb = engine.generate(
        ps.token_ids, 2, Sampling(temperature=1.0, max_new_tokens=6, seed=0), images=ps.images
    )
    assert rb.images is not None and len(rb.images) == 6
    assert all(rb.images[i] is ps.images[i // 2] for i in range(6))  # the group shares the prompt's object
    model = load_causal_lm(path, vision=True)
    gaps = []
    for i in range(6):
        keep = rb.response_mask[i].bool()
        resp = rb.response_ids[i][keep].tolist()
        ref = alone(model, ps.token_ids[i // 2], resp, ps.images[i // 2])
        gaps.append((ref - rb.rollout_logprobs[i][keep]).abs().max())
    assert max(gaps) < 1e-4, gaps
    # The pictures matter: the same prompt ids with another picture score the sampled tokens differently.
    keep = rb.response_mask[0].bool()
    resp = rb.response_ids[0][keep].tolist()
    swapped = picture((0, 0, 255))
    out = processor(text=[ps.texts[0]], images=[swapped], return_tensors="pt", add_special_tokens=False)
    blue = type(ps.images[0])((swapped,), {k: out[k] for k in ("pixel_values", "image_grid_thw")}, "b")
    assert (alone(model, ps.token_ids[0], resp, blue) - rb.rollout_logprobs[0][keep]).abs().max() > 1e-3


def test_images_for_a_text_model_are_refused(tiny_ckpt, vl):
    _, _, ps = vl
    engine = HFEngine(tiny_ckpt)
    with pytest.raises(ValueError, match="images given to a text-only model"):
        engine.generate([[1, 2, 3]], 1, Sampling(max_new_tokens=2), images=[ps.images[0]])


def test_concat_and_take_groups_carry_the_images(vl):
    from rlkit.rollout.scored import concat_rollouts, take_groups

    path, processor, ps = vl
    engine = HFEngine(path, processor.tokenizer, vision=True)
    s = Sampling(temperature=1.0, max_new_tokens=2, seed=0)
    a = engine.generate(ps.token_ids[:1], 2, s, images=ps.images[:1])
    b = engine.generate(ps.token_ids[2:], 2, s)  # text only: no images
    both = concat_rollouts([a, b])
    assert both.images == (ps.images[0], ps.images[0], None, None)
    assert take_groups(both, [1, 0]).images == (None, None, ps.images[0], ps.images[0])
