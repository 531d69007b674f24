"""Tiny random vision-language checkpoints WITH their processor, built at test time from transformers' own
classes (no download): the language model is the text families' shape (hidden 128, 2 layers, head_dim 32, see
model_families.py), the vision tower 2 blocks of width 64, the tokenizer the embedded SmolLM2 one with the
family's image tokens added, the image processor the family's own class set for small pictures (a 56x56 picture
is a handful of image tokens).

`VL_FAMILIES` maps a family's display name to its builder; `build_vl_family(name, directory)` writes one
checkpoint folder (config, weights, tokenizer, image processor, processor_config.json, chat template) and returns
it. `picture(...)` draws a small test image. Shared by the data, engine, learner and whole-run tests (imported by
name, as model_families.py is).

The processor's files are written one by one (not `processor.save_pretrained`): without torchvision (this
project's CPU environment) transformers cannot build the Qwen processors' video half, so a processor object
cannot be built or saved as a whole here; `rlkit.vision.load_processor` reads the folder back either way."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from model_families import HEAD_DIM, HEADS, HIDDEN, KV_HEADS, LAYERS, MAX_POSITIONS

_TEXT = dict(
    hidden_size=HIDDEN, intermediate_size=2 * HIDDEN, num_hidden_layers=LAYERS, num_attention_heads=HEADS,
    num_key_value_heads=KV_HEADS, max_position_embeddings=MAX_POSITIONS,
)  # fmt: skip

# A chat template in the Qwen style that renders a message's content given as a string or as a list of
# {"type": "image"} / {"type": "text", "text": ...} items; IMAGE is the family's placeholder for one picture.
_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for item in message['content'] %}"
    "{% if item['type'] == 'image' %}IMAGE"
    "{% elif item['type'] == 'text' %}{{ item['text'] }}{% endif %}{% endfor %}{% endif %}"
    "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def picture(colour=(255, 0, 0), size=(56, 56), seed: int | None = None):
    """A small RGB PIL image: one colour, or random pixels when `seed` is given."""
    from PIL import Image

    if seed is None:
        return Image.new("RGB", size, colour)
    g = torch.Generator().manual_seed(seed)
    pixels = torch.randint(0, 256, (size[1], size[0], 3), generator=g, dtype=torch.uint8)
    return Image.fromarray(pixels.numpy(), "RGB")


def _tokenizer(tokens: list[str], image_placeholder: str, named: dict | None = None):
    from rlkit.models import load_tokenizer

    tokenizer = load_tokenizer("smollm2-135m")
    tokenizer.add_special_tokens({"additional_special_tokens": tokens}, replace_extra_special_tokens=False)
    if named:
        tokenizer._set_model_specific_special_tokens(special_tokens=named)  # boi_token ... as attributes
    tokenizer.chat_template = _TEMPLATE.replace("IMAGE", image_placeholder)
    return tokenizer


def _vocab(tokenizer) -> dict:
    return dict(
        vocab_size=len(tokenizer), bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )  # fmt: skip


def _qwen25_vl(tokenizer):
    """Qwen2.5-VL: windowed vision attention (one full-attention block), 3D (mrope) rotary positions."""
    import transformers

    ids = tokenizer.convert_tokens_to_ids(
        ["<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"]
    )
    config = transformers.Qwen2_5_VLConfig(
        text_config=dict(
            _TEXT, **_vocab(tokenizer), tie_word_embeddings=True,
            rope_parameters=dict(rope_type="default", rope_theta=10000.0, mrope_section=[4, 6, 6]),  # sums to head_dim/2
        ),
        vision_config=dict(
            depth=2, hidden_size=64, intermediate_size=128, num_heads=2, out_hidden_size=HIDDEN,
            fullatt_block_indexes=[1], window_size=56, patch_size=14, spatial_merge_size=2, temporal_patch_size=2,
        ),
        vision_start_token_id=ids[0], vision_end_token_id=ids[1], image_token_id=ids[2], video_token_id=ids[3],
        tie_word_embeddings=True,
    )  # fmt: skip
    image_processor = transformers.Qwen2VLImageProcessor(
        min_pixels=28 * 28, max_pixels=56 * 56 * 4, patch_size=14, merge_size=2, temporal_patch_size=2
    )
    return config, image_processor, "Qwen2_5_VLProcessor"


def _qwen_ids(tokenizer) -> dict:
    ids = tokenizer.convert_tokens_to_ids(
        ["<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"]
    )
    return dict(
        vision_start_token_id=ids[0], vision_end_token_id=ids[1], image_token_id=ids[2], video_token_id=ids[3]
    )


_QWEN3_VISION = dict(
    depth=2, hidden_size=64, intermediate_size=128, num_heads=2, out_hidden_size=HIDDEN, patch_size=16,
    spatial_merge_size=2, temporal_patch_size=2, num_position_embeddings=64, deepstack_visual_indexes=[0],
)  # fmt: skip
_MROPE = dict(rope_type="default", rope_theta=10000.0, mrope_section=[4, 6, 6], mrope_interleaved=True)


def _qwen3_vl(tokenizer):
    """Qwen3-VL: 16-pixel patches, learned position embeddings interpolated, deepstack features, interleaved mrope."""
    import transformers

    config = transformers.Qwen3VLConfig(
        text_config=dict(_TEXT, **_vocab(tokenizer), head_dim=HEAD_DIM, rope_parameters=_MROPE),
        vision_config=_QWEN3_VISION, tie_word_embeddings=True, **_qwen_ids(tokenizer),
    )  # fmt: skip
    image_processor = transformers.Qwen2VLImageProcessor(
        min_pixels=32 * 32, max_pixels=64 * 64 * 4, patch_size=16, merge_size=2, temporal_patch_size=2
    )
    return config, image_processor, "Qwen3VLProcessor"


def _qwen35(tokenizer):
    """Qwen3.5 with its vision tower: the hybrid language model (gated DeltaNet + gated attention) of
    model_families' qwen3.5-text under Qwen3-VL's vision tower."""
    import transformers
    from model_families import _LINEAR_ATTN

    config = transformers.Qwen3_5Config(
        text_config=dict(_TEXT, **_vocab(tokenizer), head_dim=HEAD_DIM, rope_parameters=dict(
            _MROPE, partial_rotary_factor=1.0), **_LINEAR_ATTN),
        vision_config={k: v for k, v in _QWEN3_VISION.items() if k != "deepstack_visual_indexes"},
        tie_word_embeddings=True, **_qwen_ids(tokenizer),
    )  # fmt: skip
    image_processor = transformers.Qwen2VLImageProcessor(
        min_pixels=32 * 32, max_pixels=64 * 64 * 4, patch_size=16, merge_size=2, temporal_patch_size=2
    )
    return config, image_processor, "Qwen3VLProcessor"


def _gemma3(tokenizer):
    """Gemma 3 with images: a SigLIP tower (32-pixel pictures, 8-pixel patches) pooled to 4 tokens per image,
    the gemma3-text language model (sliding window, soft-capping off, q/k norms), bidirectional attention
    inside an image (token_type_ids)."""
    import transformers

    ids = tokenizer.convert_tokens_to_ids(["<start_of_image>", "<end_of_image>", "<image_soft_token>"])
    config = transformers.Gemma3Config(
        text_config=dict(
            _TEXT, **_vocab(tokenizer), head_dim=HEAD_DIM, sliding_window=16, query_pre_attn_scalar=HEAD_DIM,
            layer_types=["sliding_attention", "full_attention"],
        ),
        vision_config=dict(
            hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2, image_size=32,
            patch_size=8, vision_use_head=False,
        ),
        mm_tokens_per_image=4, boi_token_index=ids[0], eoi_token_index=ids[1], image_token_index=ids[2],
        tie_word_embeddings=True,
    )  # fmt: skip
    image_processor = transformers.Gemma3ImageProcessor(size={"height": 32, "width": 32})
    return config, image_processor, {"processor_class": "Gemma3Processor", "image_seq_length": 4}


_IDEFICS3_TOKENS = ["<fake_token_around_image>", "<image>", "<global-img>", "<end_of_utterance>"] + [
    f"<row_{i + 1}_col_{j + 1}>" for i in range(6) for j in range(6)
]


def _idefics3(tokenizer):
    """SmolVLM / Idefics3: a SigLIP tower (32-pixel pictures, 8-pixel patches), pixel shuffle by 2 (4 tokens per
    image), the Llama language model of model_families; no image splitting."""
    import transformers

    config = transformers.Idefics3Config(
        text_config=dict(_TEXT, **_vocab(tokenizer), head_dim=HEAD_DIM, model_type="llama"),
        vision_config=dict(
            hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2, image_size=32,
            patch_size=8,
        ),
        scale_factor=2, image_token_id=tokenizer.convert_tokens_to_ids("<image>"), tie_word_embeddings=True,
        pad_token_id=tokenizer.pad_token_id,
    )  # fmt: skip
    image_processor = transformers.Idefics3ImageProcessor(
        do_image_splitting=False, size={"longest_edge": 32}, max_image_size={"longest_edge": 32}
    )
    return config, image_processor, {"processor_class": "Idefics3Processor", "image_seq_len": 4}


_QWEN_TOKENS = ["<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"]
_QWEN_PLACEHOLDER = "<|vision_start|><|image_pad|><|vision_end|>"
# display name -> (tokens added to the tokenizer, the chat template's placeholder for one image, builder)
VL_FAMILIES: dict[str, tuple[list[str], str, object]] = {
    "qwen2.5-vl": (_QWEN_TOKENS, _QWEN_PLACEHOLDER, _qwen25_vl),
    "qwen3-vl": (_QWEN_TOKENS, _QWEN_PLACEHOLDER, _qwen3_vl),
    "qwen3.5": (_QWEN_TOKENS, _QWEN_PLACEHOLDER, _qwen35),
    "smolvlm": (_IDEFICS3_TOKENS, "<image>", _idefics3),
    "gemma3": (["<start_of_image>", "<end_of_image>", "<image_soft_token>"], "<start_of_image>", _gemma3),
}
# Tokenizer attributes a family's processor reads (saved in tokenizer_config.json's extra_special_tokens).
_NAMED_TOKENS = {
    "gemma3": {
        "boi_token": "<start_of_image>",
        "eoi_token": "<end_of_image>",
        "image_token": "<image_soft_token>",
    },
}


def build_vl_family(name: str, directory, *, seed: int = 0, processor: bool = True) -> str:
    """Write a random tiny VL checkpoint of family `name` (fp32) with its processor (unless `processor` is
    False: a VL checkpoint without one, for the start-up error's test); returns the folder."""
    from transformers import AutoModelForImageTextToText, GenerationConfig

    tokens, placeholder, builder = VL_FAMILIES[name]
    tokenizer = _tokenizer(tokens, placeholder, _NAMED_TOKENS.get(name))
    config, image_processor, processor_class = builder(tokenizer)
    torch.manual_seed(seed)
    model = AutoModelForImageTextToText.from_config(config, dtype=torch.float32)
    projector = getattr(model.model, "multi_modal_projector", None)
    if projector is not None and hasattr(projector, "mm_input_projection_weight"):
        # Gemma 3 initialises its projector to zeros: a random model would not see its images at all.
        torch.nn.init.normal_(projector.mm_input_projection_weight, std=0.5)
    model.generation_config = GenerationConfig(
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )  # fmt: skip
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    if processor:
        image_processor.save_pretrained(directory)
        if isinstance(processor_class, str):
            processor_class = {"processor_class": processor_class}
        (directory / "processor_config.json").write_text(json.dumps(processor_class))
        (directory / "chat_template.jinja").write_text(tokenizer.chat_template)
    return str(directory)


def logprobs_alone(
    model, processor, text: str, pictures, response: list[int], *, grad: bool = False
) -> torch.Tensor:
    """The naive reference for a row with images: the model on the one row, unpadded, given exactly what the
    processor makes of its prompt (`text` and `pictures`; its per-token outputs, such as the image token types,
    extended with zeros over the response) and nothing else (the model computes its own positions). The
    log-probs of `response`'s tokens (with their graph when `grad`)."""
    if pictures:
        out = processor(text=[text], images=list(pictures), return_tensors="pt", add_special_tokens=False)
    else:
        out = processor.tokenizer([text], return_tensors="pt", add_special_tokens=False)
    prompt = out["input_ids"]
    ids = torch.cat([prompt, torch.tensor([response])], 1)
    kw = {}
    for key, value in out.items():
        if key in ("input_ids", "attention_mask"):
            continue
        if key.endswith("token_type_ids"):
            value = torch.cat([value, torch.zeros(1, len(response), dtype=value.dtype)], 1)
        kw[key] = value
    with torch.set_grad_enabled(grad):
        logits = model(input_ids=ids, **kw).logits.float()
    logp = torch.log_softmax(logits[0, :-1], -1).gather(-1, ids[0, 1:, None]).squeeze(-1)
    return logp[prompt.shape[1] - 1 :]


def family_params() -> list:
    """pytest params over VL_FAMILIES: Qwen2.5-VL in the fast tier, the other families `slow` (each costs a few
    seconds per test; `make test` runs them all)."""
    import pytest

    return [pytest.param(f, marks=() if f == "qwen2.5-vl" else pytest.mark.slow) for f in sorted(VL_FAMILIES)]
