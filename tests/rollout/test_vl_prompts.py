"""Prompts with images in the form vLLM 0.32 expands (rlkit/rollout/engines/vllm/images.py), without an engine:
each family's collapse of the processor's expansion against the unexpanded ids worked out independently, the
refusals, and the requests built."""

import pytest
import torch
from vl_helpers import build_idefics3, build_qwen25_vl, picture

from rlkit.batch import Images
from rlkit.rollout.engines.vllm.images import VLPrompts, vl_refusal, vllm_requests


class _Config:
    def __init__(self, model_type: str, vision: bool = True):
        self.model_type, self.vision_config = model_type, ({} if vision else None)


@pytest.fixture(scope="module")
def idefics3(tmp_path_factory):
    from transformers import AutoConfig, AutoProcessor

    from rlkit.models import load_tokenizer

    directory = build_idefics3(tmp_path_factory.mktemp("idefics3"), splitting=True)
    return (
        directory,
        AutoConfig.from_pretrained(directory),
        AutoProcessor.from_pretrained(directory),
        load_tokenizer(directory),
    )


def test_idefics3_tiles_and_global_view_collapse_to_one_image_token_each(idefics3):
    _, config, processor, tokenizer = idefics3
    text = "<image>Look.<image> Which?"
    pictures = [picture(1), picture(2, (40, 64))]
    expanded = processor(text=[text], images=[pictures])["input_ids"][0]
    # the unexpanded prompt, tokenised on its own: what vLLM expands from the pictures
    plain = tokenizer(text, add_special_tokens=False)["input_ids"]
    assert len(expanded) > len(plain) + 40  # two pictures of 2x2 tiles + a global view, 4 image tokens each
    vl = VLPrompts(config, tokenizer)
    assert vl.collapse(expanded, tuple(pictures), "prompts[0]") == plain
    with pytest.raises(ValueError, match=r"prompts\[3\] holds 2 image placeholder block\(s\) for 1 picture"):
        vl.collapse(expanded, (pictures[0],), "prompts[3]")


def test_qwen_runs_of_image_pads_collapse_to_one(tmp_path):
    from transformers import AutoConfig

    from rlkit.models import load_tokenizer

    directory = build_qwen25_vl(tmp_path / "q", processor=False)
    tokenizer = load_tokenizer(directory)
    start, end, pad = (
        tokenizer.convert_tokens_to_ids(t) for t in ("<|vision_start|>", "<|vision_end|>", "<|image_pad|>")
    )
    vl = VLPrompts(AutoConfig.from_pretrained(directory), tokenizer)
    expanded = [7, start, pad, pad, pad, pad, end, 8, 9, start, pad, pad, end, 10]
    assert vl.collapse(expanded, ("a", "b"), "p") == [7, start, pad, end, 8, 9, start, pad, end, 10]


def test_requests_carry_the_pictures_and_refuse_images_for_a_text_model(idefics3):
    _, config, processor, tokenizer = idefics3
    pic = picture(3)
    ids = processor(text=["<image>Hi"], images=[[pic]])["input_ids"][0]
    images = Images(pictures=(pic,), tensors={"pixel_values": torch.zeros(1)}, digest="d")
    got = vllm_requests([ids, [1, 2]], [images, None], VLPrompts(config, tokenizer), cache_salt="s")
    assert got[0]["multi_modal_data"] == {"image": [pic]} and got[0]["cache_salt"] == "s"
    assert got[0]["prompt_token_ids"] == tokenizer("<image>Hi", add_special_tokens=False)["input_ids"]
    assert got[1] == {"prompt_token_ids": [1, 2], "cache_salt": "s"}
    with pytest.raises(ValueError, match=r"images\[0\] holds 1 picture\(s\), but the model takes no images"):
        vllm_requests([ids], [images], None)
    with pytest.raises(ValueError, match="images has 1 entries for 2 prompts"):
        vllm_requests([ids, ids], [images], None)


def test_refusals_name_the_family_or_the_processor(idefics3, tmp_path):
    directory, config, _, _ = idefics3
    assert vl_refusal(config, directory) is None
    assert vl_refusal(_Config("llama", vision=False), directory) is None  # a text model: nothing to refuse
    assert "model_type 'llava'" in vl_refusal(_Config("llava"), directory)
    no_processor = build_idefics3(tmp_path / "bare", processor=False)
    assert "image processor does not load here" in vl_refusal(config, no_processor)


def test_qwen25_vl_is_refused_where_its_processor_does_not_load(tmp_path):
    """vLLM renders a prompt's images with the checkpoint's HF processor: where transformers cannot load it (Qwen's
    VL processors need torchvision for their video processor; the CPU install removes torchvision), the family is
    refused at start-up with transformers' own reason."""
    import importlib.util

    from transformers import AutoConfig

    if importlib.util.find_spec("torchvision") is not None:
        pytest.skip("torchvision is installed: Qwen2.5-VL's processor loads")
    directory = build_qwen25_vl(tmp_path / "q")
    why = vl_refusal(AutoConfig.from_pretrained(directory), directory)
    assert "image processor does not load here" in why and "torchvision" in why.lower(), why
