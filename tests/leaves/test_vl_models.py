"""Vision-language checkpoints: recognised by their config, loaded with AutoModelForImageTextToText and their
processor (tests/vl_families.py builds them); a VL checkpoint without a processor is an error naming model.path."""

from __future__ import annotations

import pytest
import torch
from vl_families import build_vl_family, family_params, picture

from rlkit.models import is_vision_language, load_causal_lm
from rlkit.vision import load_processor

QUESTION = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What colour?"}]}]


@pytest.fixture(scope="module", params=family_params())
def vl_ckpt(request, tmp_path_factory):
    return request.param, build_vl_family(request.param, tmp_path_factory.mktemp(request.param))


def test_vl_checkpoint_loads_with_its_processor(vl_ckpt):
    name, path = vl_ckpt
    assert is_vision_language(path)
    processor = load_processor(path)
    assert processor.tokenizer.padding_side == "left"
    text = processor.apply_chat_template(QUESTION, add_generation_prompt=True, tokenize=False)
    out = processor(text=[text], images=[picture(size=(56, 56))], return_tensors="pt")
    ids = out["input_ids"][0]
    image_token = processor.tokenizer.convert_tokens_to_ids(processor.image_token)
    if name.startswith("qwen"):  # 56x56 -> a 4x4 grid of 14-pixel patches, merged 2x2: 4 image tokens
        assert out["image_grid_thw"].tolist() == [[1, 4, 4]]
        assert int((ids == image_token).sum()) == 4
    model = load_causal_lm(path, vision=True)
    assert "ImageTextToText" in type(model).__name__ or "ConditionalGeneration" in type(model).__name__
    with torch.no_grad():
        logits = model(**out).logits
    assert logits.shape == (1, ids.shape[0], len(processor.tokenizer))
    assert torch.isfinite(logits).all()


def test_text_checkpoint_is_not_vision_language(tiny_ckpt):
    assert not is_vision_language(tiny_ckpt)
    assert "LlamaForCausalLM" in type(load_causal_lm(tiny_ckpt)).__name__


def test_vl_checkpoint_without_processor_names_model_path(tmp_path):
    path = build_vl_family("qwen2.5-vl", tmp_path / "noproc", processor=False)
    assert is_vision_language(path)
    with pytest.raises(ValueError, match=r"model\.path=.*without a processor"):
        load_processor(path)
