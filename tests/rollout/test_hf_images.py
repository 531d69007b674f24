"""The HF engine generates with images (a tiny Qwen2.5-VL, tests/vl_families.py): the log-prob of every sampled
token equals the model's own on the row alone (unpadded, the processor's outputs, the model computing its 3D
positions), whatever the left padding of the batch; the batch's rows carry their prompt's Images."""

from __future__ import annotations

import pytest
from vl_families import build_vl_family, family_params, logprobs_alone, picture

from rlkit.config.schema import DataConfig
from rlkit.data.prompts import build_prompts
from rlkit.models import load_causal_lm
from rlkit.rollout.engines.base import Sampling
from rlkit.rollout.engines.hf import HFEngine
from rlkit.vision import load_processor


@pytest.fixture(scope="module", params=family_params())
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
        pictures = ps.images[i // 2].pictures if ps.images[i // 2] is not None else ()
        ref = logprobs_alone(model, processor, ps.texts[i // 2], pictures, resp)
        gaps.append((ref - rb.rollout_logprobs[i][keep]).abs().max())
    assert max(gaps) < 1e-4, gaps
    # The pictures matter: the same prompt ids with another picture score the sampled tokens differently.
    keep = rb.response_mask[0].bool()
    resp = rb.response_ids[0][keep].tolist()
    blue = logprobs_alone(model, processor, ps.texts[0], [picture((0, 0, 255))], resp)
    assert (blue - rb.rollout_logprobs[0][keep]).abs().max() > 1e-3


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
