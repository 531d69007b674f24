"""A tiny random Qwen2.5-VL checkpoint with its processor, built at test time (no downloads): the SmolLM2
tokenizer plus Qwen's vision special tokens, a 2-layer language model of the families' shape (hidden 128,
head_dim 32, the smallest vLLM's CPU attention runs) with Qwen's 3D rotary sections, and a 2-block vision tower
(hidden 64, 2 heads of 32; the second block is full attention, the first windowed). The image processor's pixel
budget keeps pictures small: a 56x56 picture is 4x4 patches of 14 pixels, 4 image tokens after the 2x2 merge.

`vl_prompt` renders one user turn with the picture's placeholder and returns the processor's expanded ids and
tensors as rlkit.batch.Images; `hf_logprobs` is the naive forward of the same checkpoint (transformers'
AutoModelForImageTextToText) on those tensors. Shared by the vLLM image tests (imported by name)."""

from __future__ import annotations

import hashlib
import importlib.util
import json
from pathlib import Path

import torch
from model_families import _DENSE, HEAD_DIM

VISION_TOKENS = ["<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"]


def picture(seed: int, size: tuple[int, int] = (56, 56)):
    """A random RGB PIL picture (deterministic in `seed`)."""
    from PIL import Image

    g = torch.Generator().manual_seed(seed)
    pixels = torch.randint(0, 256, (size[1], size[0], 3), generator=g, dtype=torch.uint8)
    return Image.fromarray(pixels.numpy(), "RGB")


def build_qwen25_vl(directory, *, seed: int = 0, processor: bool = True) -> str:
    """Write a random tiny Qwen2.5-VL checkpoint (fp32) and its processor (`processor=False`: the tokenizer only)
    to `directory`. transformers builds Qwen's VL processors only with torchvision (their video processor): without
    it the processor's files are written by hand, as the hub has them, and do not load."""
    from transformers import (
        AutoModelForImageTextToText,
        GenerationConfig,
        Qwen2_5_VLConfig,
        Qwen2_5_VLProcessor,
        Qwen2VLImageProcessorPil,
    )

    from rlkit.models import load_tokenizer

    tokenizer = load_tokenizer("smollm2-135m")
    tokenizer.add_special_tokens({"additional_special_tokens": VISION_TOKENS})
    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in VISION_TOKENS}
    text = dict(
        _DENSE, head_dim=HEAD_DIM, vocab_size=len(tokenizer), bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id, tie_word_embeddings=False,
        rope_parameters=dict(rope_type="default", rope_theta=10000.0, mrope_section=[4, 6, 6]),
    )  # fmt: skip
    vision = dict(
        depth=2, hidden_size=64, intermediate_size=128, num_heads=2, out_hidden_size=128, fullatt_block_indexes=[1],
        window_size=56,
    )  # fmt: skip
    config = Qwen2_5_VLConfig(
        text_config=text, vision_config=vision, image_token_id=ids["<|image_pad|>"],
        video_token_id=ids["<|video_pad|>"], vision_start_token_id=ids["<|vision_start|>"],
        vision_end_token_id=ids["<|vision_end|>"], tie_word_embeddings=False,
    )  # fmt: skip
    torch.manual_seed(seed)
    model = AutoModelForImageTextToText.from_config(config, dtype=torch.float32)
    model.generation_config = GenerationConfig(
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )  # fmt: skip
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(directory)
    image_processor = Qwen2VLImageProcessorPil(min_pixels=56 * 56, max_pixels=112 * 112)
    if processor and importlib.util.find_spec("torchvision") is not None:
        Qwen2_5_VLProcessor(image_processor=image_processor, tokenizer=tokenizer).save_pretrained(directory)
        return str(directory)
    tokenizer.save_pretrained(directory)
    if (
        processor
    ):  # the processor's files as the hub has them (transformers cannot build it without torchvision)
        image_processor.save_pretrained(directory)
        (directory / "processor_config.json").write_text(
            json.dumps({"processor_class": "Qwen2_5_VLProcessor"})
        )
    return str(directory)


def vl_prompt(processor, text: str, pictures) -> tuple[list[int], object]:
    """One user turn `<|vision_start|><|image_pad|><|vision_end|>` per picture, then `text`: the processor's
    expanded prompt ids and the pictures as rlkit.batch.Images."""
    from rlkit.batch import Images

    marked = "".join("<|vision_start|><|image_pad|><|vision_end|>" for _ in pictures) + text
    out = processor(text=[marked], images=list(pictures), return_tensors="pt")
    tensors = {k: v for k, v in out.items() if k not in ("input_ids", "attention_mask")}
    digest = hashlib.sha256(b"".join(p.tobytes() for p in pictures)).hexdigest()
    return out["input_ids"][0].tolist(), Images(pictures=tuple(pictures), tensors=tensors, digest=digest)


def hf_logprobs(model, ids: list[int], images) -> torch.Tensor:
    """[len(ids) - 1] float32: log p(ids[t] | ids[:t]) from a plain transformers forward with the images (None:
    text alone)."""
    tokens = torch.tensor([ids])
    tensors = images.tensors if images is not None else {}
    with torch.no_grad():
        logits = model(input_ids=tokens, attention_mask=torch.ones_like(tokens), **tensors).logits.float()
    return torch.log_softmax(logits[0, :-1], -1).gather(-1, tokens[0, 1:, None]).squeeze(-1)


def build_idefics3(directory, *, seed: int = 0, splitting: bool = False, processor: bool = True) -> str:
    """Write a random tiny Idefics3 checkpoint (fp32, a Llama language model) and its processor: 64-pixel tiles of
    16-pixel patches, merged 2x2 (4 image tokens a tile); `splitting` splits a larger picture into tiles plus its
    global view, as SmolVLM does. `processor=False`: the tokenizer only, no image processor."""
    from transformers import (
        AutoModelForImageTextToText,
        GenerationConfig,
        Idefics3Config,
        Idefics3ImageProcessorPil,
        Idefics3Processor,
    )

    from rlkit.models import load_tokenizer

    tokenizer = load_tokenizer("smollm2-135m")
    grid = [f"<row_{i + 1}_col_{j + 1}>" for i in range(6) for j in range(6)]
    tokenizer.add_special_tokens(
        {
            "additional_special_tokens": [
                "<fake_token_around_image>",
                "<image>",
                "<end_of_utterance>",
                "<global-img>",
                *grid,
            ]
        }
    )
    text = dict(
        _DENSE, model_type="llama", head_dim=HEAD_DIM, vocab_size=len(tokenizer), bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id, tie_word_embeddings=False,
    )  # fmt: skip
    vision = dict(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2, image_size=64, patch_size=16
    )  # fmt: skip
    config = Idefics3Config(
        text_config=text, vision_config=vision, scale_factor=2,
        image_token_id=tokenizer.convert_tokens_to_ids("<image>"), tie_word_embeddings=False,
    )  # fmt: skip
    torch.manual_seed(seed)
    model = AutoModelForImageTextToText.from_config(config, dtype=torch.float32)
    model.generation_config = GenerationConfig(
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )  # fmt: skip
    image_processor = Idefics3ImageProcessorPil(
        size={"longest_edge": 128 if splitting else 64}, max_image_size={"longest_edge": 64},
        do_image_splitting=splitting,
    )  # fmt: skip
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(directory)
    if processor:
        Idefics3Processor(
            image_processor=image_processor, tokenizer=tokenizer, image_seq_len=4
        ).save_pretrained(directory)
    else:
        tokenizer.save_pretrained(directory)
    return str(directory)
