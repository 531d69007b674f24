"""The learner on a vision-language model (a tiny Qwen2.5-VL, tests/vl_families.py): each row's log-probs equal
the model's on the row alone, unpadded, with the processor's outputs (the model computing its 3D positions);
chunked and full heads agree, padded and packed (tests/learner/test_vl_packing.py holds packing's gradients); the
vision tower is frozen by default; LoRA adapts the language model only; packing stays on except for Qwen3.5,
whose gated-DeltaNet layers carry state across rows (one INFO line naming it)."""

from __future__ import annotations

import logging

import pytest
import torch
from cfg_helpers import learner_cfg
from vl_families import build_vl_family, family_params, logprobs_alone, picture

from rlkit.batch import Sequences
from rlkit.config.schema import DataConfig
from rlkit.data.prompts import build_prompts
from rlkit.learner import Learner
from rlkit.models import load_causal_lm
from rlkit.vision import load_processor


@pytest.fixture(scope="module", params=family_params())
def vl(request, tmp_path_factory):
    path = build_vl_family(request.param, tmp_path_factory.mktemp(request.param))
    processor = load_processor(path)
    cfg = DataConfig(path="/nonexistent", image_key="image", prompt_key="q", answer_key="a", instruction="")
    rows = [
        {"q": "Colour?", "a": "r", "image": picture((255, 0, 0))},
        {"q": "A much longer question that pads the other rows on the left?", "a": "x", "image": picture(seed=1, size=(112, 56))},
        {"q": "<image> and <image>: which?", "a": "y", "image": [picture(seed=2), picture((0, 0, 255))]},
        {"q": "No picture, text only.", "a": "z", "image": None},
    ]  # fmt: skip
    return path, processor, build_prompts(rows, processor.tokenizer, cfg, processor=processor)


def sequences(ps, response_lens=(5, 3, 6, 4), seed=0) -> Sequences:
    g = torch.Generator().manual_seed(seed)
    n, width, T = len(ps), max(map(len, ps.token_ids)), max(response_lens)
    prompt_ids = torch.zeros(n, width, dtype=torch.long)
    prompt_mask = torch.zeros(n, width, dtype=torch.bool)
    for i, p in enumerate(ps.token_ids):
        prompt_ids[i, width - len(p) :] = torch.tensor(p)
        prompt_mask[i, width - len(p) :] = True
    response_ids = torch.randint(10, 4000, (n, T), generator=g)
    response_mask = torch.arange(T)[None] < torch.tensor(response_lens)[:, None]
    return Sequences(prompt_ids, prompt_mask, response_ids, response_mask, tuple(ps.images))


def vl_cfg(path, **flat):
    cfg = learner_cfg(model_path=path, lr=1e-3, max_grad_norm=None, **flat)
    cfg.data.image_key = "image"
    return cfg


def assert_rows_score_alone(learner, path, processor, ps) -> None:
    """The learner's log-probs of every row of `ps` equal plain transformers' on that row alone (within 1e-4)."""
    rows = sequences(ps)
    got = learner.forward(rows).logprobs
    model = load_causal_lm(path, vision=True)
    for i in range(len(ps)):
        keep = rows.response_mask[i]
        pictures = ps.images[i].pictures if ps.images[i] is not None else ()
        ref = logprobs_alone(model, processor, ps.texts[i], pictures, rows.response_ids[i][keep].tolist())
        assert torch.allclose(got[i][keep], ref, atol=1e-4), (i, (got[i][keep] - ref).abs().max())


@pytest.mark.parametrize(
    ("chunk", "pack"), [(0, False), (8, False), (8, True)], ids=["full-head", "chunked", "chunked-packed"]
)
def test_learner_logprobs_equal_each_row_alone(vl, chunk, pack):
    path, processor, ps = vl
    learner = Learner(
        vl_cfg(path, logprob_chunk_tokens=chunk, max_tokens_per_microbatch=10_000, pack_sequences=pack)
    )
    assert_rows_score_alone(learner, path, processor, ps)


def test_vision_tower_frozen_by_default_and_packing_on_but_for_the_hybrid(vl, caplog):
    path, _, _ = vl
    with caplog.at_level(logging.INFO, logger="rlkit.learner.batching"):
        learner = Learner(vl_cfg(path, pack_sequences=True))
    hybrid = learner.model.config.model_type == "qwen3_5"
    assert learner.packed is not hybrid
    off = [r.message for r in caplog.records if "packing is off" in r.message]
    assert len(off) == int(hybrid)
    if hybrid:
        (message,) = off
        assert "packing is off for this model (qwen3_5): its linear_attention layers carry state" in message
    named = dict(learner.model.named_parameters())
    visual = [
        n for n in named if any(f".{t}." in f".{n}" for t in ("visual", "vision_tower", "vision_model"))
    ]
    assert visual and not any(named[n].requires_grad for n in visual)
    assert all(p.requires_grad for n, p in named.items() if n not in visual)
    trained = {id(p) for group in learner.optimizer.param_groups for p in group["params"]}
    assert not any(id(named[n]) in trained for n in visual)
    cfg = vl_cfg(path)
    cfg.model.freeze_vision = False
    assert all(p.requires_grad for p in Learner(cfg).model.parameters())


def test_lora_adapts_the_language_model_only(vl):
    path, processor, ps = vl
    learner = Learner(vl_cfg(path, lora_rank=4, pack_sequences=True, max_tokens_per_microbatch=10_000))
    adapted = [n for n, _ in learner.model.named_parameters() if "lora_A" in n]
    assert adapted and all(".language_model." in n or ".text_model." in n for n in adapted)
    assert not any(".visual." in n for n in adapted)
    if (
        "qwen2.5-vl" in path
    ):  # its vision MLP shares the language model's layer names (gate_proj ...): no adapter
        names = [n for n, _ in learner.model.named_parameters()]
        assert any(n.endswith("visual.blocks.0.mlp.gate_proj.weight") for n in names)
    # Packed through the peft wrapper (Qwen's per-row 3D positions read its base model): the adapters start at
    # zero, so each row scores as the base model's row alone.
    assert_rows_score_alone(learner, path, processor, ps)


def test_rows_without_images_are_refused_under_fsdp2():
    from rlkit.batch import Images
    from rlkit.learner.batching import check_sharded_images

    pics = Images((), {}, "d")
    check_sharded_images((pics, pics), sharded=True)
    check_sharded_images((pics, None), sharded=False)
    for images in ((pics, None), None):
        with pytest.raises(
            ValueError, match=r"trainer\.strategy=fsdp2 with data\.image_key: .*rows without images"
        ):
            check_sharded_images(images, sharded=True)
