"""A vision-language checkpoint built offline from a text model: the embedded SmolLM2-135M given eyes.

No vision-language weights can be downloaded on an offline CPU machine, but SmolVLM-256M is Idefics3 with a
SmolLM2-135M text model. `build_idefics3` writes the same architecture with the text model's own weights, a
small randomly initialised SigLIP-like vision encoder and the Idefics3 connector (pixel shuffle, then one linear
projection into the text model's width), and an `Idefics3Processor` around the text model's tokenizer with the
image tokens added. The vision side knows nothing until it is trained: a short supervised warm-up on rlkit's
generated pictures (rlkit/data/pictures.py; `python -m rlkit.sft +recipe=sft_see`) teaches it to see them.

The chat template is the text model's own ChatML, which also takes a message's content as a list of
`{"type": "image"}` / `{"type": "text", "text": ...}` parts (an image part becomes `<image>`, which the
processor expands to the image's tokens), so the instruct model's turn format carries over unchanged.

This module imports only third-party packages (lazily); rlkit.models resolves the short name
`smollm2-135m-vl` through it into `$RLKIT_CACHE/models/`.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

VERSION = 1
"""Bumped when what `build_idefics3` writes changes: the cache folder's name carries it."""
SYSTEM = "You are a helpful AI assistant named SmolLM, trained by Hugging Face"
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\\n" + SYSTEM + "<|im_end|>\\n' }}{% endif %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' }}"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'image' %}{{ '<image>' }}{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}"
    "{% endfor %}{% endif %}"
    "{{ '<|im_end|>\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
"""SmolLM2's ChatML template, its content either a string or a list of image / text parts."""
IMAGE_TOKENS = (
    ["<fake_token_around_image>", "<image>", "<end_of_utterance>", "<global-img>"]
    + [f"<row_{i}_col_{j}>" for i in range(1, 7) for j in range(1, 7)]
)  # fmt: skip
"""The special tokens Idefics3's processor writes around an image (the row / column tags only when it splits
an image into tiles, which this processor does not: they are added so that every token it can write is one)."""


@dataclass(frozen=True)
class VisionShape:
    """The random vision encoder's size: a SigLIP-like ViT on `image_size` pixels in `patch_size` patches;
    `(image_size // patch_size) ** 2 / scale_factor ** 2` image tokens per picture reach the text model."""

    image_size: int = 64
    patch_size: int = 8
    hidden_size: int = 128
    intermediate_size: int = 512
    num_layers: int = 2
    num_heads: int = 4
    scale_factor: int = 2

    @property
    def image_seq_len(self) -> int:
        return (self.image_size // self.patch_size) ** 2 // self.scale_factor**2


def _idefics3_config(text_config, tokenizer, shape: VisionShape):
    from transformers import Idefics3Config

    text = text_config.to_dict()
    text["vocab_size"] = len(tokenizer)
    return Idefics3Config(
        text_config=text,
        vision_config={
            "hidden_size": shape.hidden_size,
            "intermediate_size": shape.intermediate_size,
            "num_hidden_layers": shape.num_layers,
            "num_attention_heads": shape.num_heads,
            "image_size": shape.image_size,
            "patch_size": shape.patch_size,
            "num_channels": 3,
        },
        scale_factor=shape.scale_factor,
        image_token_id=tokenizer.convert_tokens_to_ids("<image>"),
        pad_token_id=tokenizer.pad_token_id,
        tie_word_embeddings=bool(text_config.tie_word_embeddings),
    )


def build_processor(tokenizer, shape: VisionShape):
    """An `Idefics3Processor` around `tokenizer` (changed in place: the image tokens added, the chat template
    set) that resizes a picture to `shape.image_size` square and never splits it into tiles."""
    from transformers import Idefics3ImageProcessorPil, Idefics3Processor

    tokenizer.add_special_tokens({"additional_special_tokens": IMAGE_TOKENS})
    tokenizer.chat_template = CHAT_TEMPLATE
    image_processor = Idefics3ImageProcessorPil(
        do_resize=True,
        size={"longest_edge": shape.image_size},
        max_image_size={"longest_edge": shape.image_size},
        do_image_splitting=False,
        image_mean=[0.5, 0.5, 0.5],
        image_std=[0.5, 0.5, 0.5],
    )
    return Idefics3Processor(
        image_processor, tokenizer, image_seq_len=shape.image_seq_len, chat_template=CHAT_TEMPLATE
    )


def build_idefics3(
    text_dir: str | os.PathLike, target: str | os.PathLike, *, shape=VisionShape(), seed=0
) -> str:
    """Write an Idefics3 checkpoint and its processor at `target` (atomically: a temporary folder renamed into
    place; an existing one is kept): the text model and tokenizer of the plain Llama checkpoint `text_dir`, the
    image tokens' embeddings at the mean of the others, a random vision encoder and connector of `shape` drawn
    from `seed`. Returns `target`."""
    import torch
    from transformers import (
        AutoTokenizer,
        GenerationConfig,
        Idefics3ForConditionalGeneration,
        LlamaForCausalLM,
    )

    target = Path(target)
    if (target / "config.json").exists():
        return str(target)
    text = LlamaForCausalLM.from_pretrained(text_dir, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(text_dir)
    processor = build_processor(tokenizer, shape)
    config = _idefics3_config(text.config, tokenizer, shape)
    torch.manual_seed(seed)
    model = Idefics3ForConditionalGeneration(config).to(torch.float32)
    embed = text.get_input_embeddings().weight.detach()
    missing, unexpected = model.model.text_model.load_state_dict(
        {
            k.removeprefix("model."): v
            for k, v in text.state_dict().items()
            if k.startswith("model.") and k != "model.embed_tokens.weight"
        },
        strict=False,
    )
    if unexpected or [k for k in missing if k != "embed_tokens.weight"]:
        raise RuntimeError(
            f"{text_dir}: text weights do not fit Idefics3 (missing {missing}, unexpected {unexpected})"
        )
    with torch.no_grad():
        new = model.model.text_model.embed_tokens.weight
        new[: embed.shape[0]] = embed
        new[embed.shape[0] :] = embed.mean(0)
        if not config.tie_word_embeddings:
            head = text.get_output_embeddings().weight.detach()
            model.lm_head.weight[: head.shape[0]] = head
            model.lm_head.weight[head.shape[0] :] = head.mean(0)
    model.tie_weights()
    model.generation_config = GenerationConfig(
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=target.parent))
    try:
        model.save_pretrained(tmp)
        processor.save_pretrained(tmp)
        try:
            os.rename(tmp, target)
        except OSError:
            if not (target / "config.json").exists():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return str(target)
