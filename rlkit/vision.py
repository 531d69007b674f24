"""What a vision-language model needs beyond a text model: its processor (loaded, checked for a run with images,
copied into checkpoints), the image arguments of its forward (the processor's tensors joined over rows, the
token types, Qwen's 3D positions), and its vision tower (found and frozen). The checkpoint itself is found and
loaded by rlkit.models, as every model is."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import torch

from rlkit.models import is_vision_language, load_tokenizer, read_regular, resolve_model

PROCESSOR_FILES = ("processor_config.json", "preprocessor_config.json")


def images_problem(path: str | os.PathLike) -> str | None:
    """Why the checkpoint at `path` cannot take images, as the end of a sentence ("is a text-only model ...",
    "is a vision-language checkpoint without a processor ..."), or None: it can, or its config cannot be read
    now (a hub id out of reach: the model's own load says so)."""
    try:
        vision = is_vision_language(path)
    except OSError:
        return None
    if not vision:
        return "is a text-only model (its config has no vision_config): use a vision-language checkpoint"
    folder = Path(resolve_model(path)[0])
    if folder.is_dir() and not any((folder / f).is_file() for f in PROCESSOR_FILES):
        return (
            f"is a vision-language checkpoint without a processor (none of {list(PROCESSOR_FILES)}): save its "
            "AutoProcessor beside it"
        )
    return None


def load_processor(path: str | os.PathLike):
    """The `AutoProcessor` of a vision-language checkpoint, its tokenizer set up as `load_tokenizer`'s.

    A checkpoint without a processor is an error naming `model.path`. Without torchvision, transformers cannot
    build the video half of some processors (Qwen's); rlkit gives no videos, so the processor is then built
    from its image processor and tokenizer alone (`video_processor=None`)."""
    from transformers import AutoImageProcessor, AutoProcessor

    directory, _ = resolve_model(path)
    local = Path(directory)
    if local.is_dir() and not any((local / f).is_file() for f in PROCESSOR_FILES):
        raise ValueError(
            f"model.path={str(path)!r} is a vision-language checkpoint without a processor (none of "
            f"{list(PROCESSOR_FILES)} in the folder): save the model's AutoProcessor beside it "
            "(AutoProcessor.from_pretrained(base).save_pretrained(path))"
        )
    tokenizer = load_tokenizer(path)
    try:
        processor = AutoProcessor.from_pretrained(directory, tokenizer=tokenizer)
    except ImportError as e:
        if "torchvision" not in str(e).lower():
            raise
        processor = _images_only_processor(
            directory, tokenizer, AutoImageProcessor.from_pretrained(directory)
        )
    processor.tokenizer = tokenizer
    if not getattr(processor, "chat_template", None):
        processor.chat_template = tokenizer.chat_template
    return processor


def _images_only_processor(directory: str, tokenizer, image_processor):
    """The checkpoint's processor class built with `video_processor=None` (see `load_processor`)."""
    from transformers.models.auto.processing_auto import processor_class_from_name

    folder = Path(directory)
    names = [
        json.loads(read_regular(folder / f)).get("processor_class")
        for f in PROCESSOR_FILES
        if (folder / f).is_file()
    ]
    name = next(n for n in names if n)
    cls = processor_class_from_name(name)

    class ImagesOnly(cls):
        def check_argument_for_proper_class(self, argument_name, argument):
            if argument is not None:
                return super().check_argument_for_proper_class(argument_name, argument)

    ImagesOnly.__name__ = cls.__name__
    template = folder / "chat_template.jinja"
    chat_template = read_regular(template).decode() if template.is_file() else tokenizer.chat_template
    return ImagesOnly(
        image_processor=image_processor,
        tokenizer=tokenizer,
        video_processor=None,
        chat_template=chat_template,
    )


def image_kwargs(model, images, input_ids: torch.Tensor) -> dict:
    """The keyword arguments a vision-language `model`'s forward takes for rows `input_ids` [B, L] whose images
    are `images` (one rlkit.batch.Images or None per row, in row order): each processor tensor concatenated over
    the rows that have images (the placeholders of `input_ids` take the image features in that order) and, where
    the forward reads them, the token types (1 at image tokens: Qwen's 3D rotary positions are computed from
    them and the grid sizes; Gemma 3 attends both ways inside an image). {} when no row has an image."""
    import inspect

    present = [x for x in images if x is not None] if images is not None else []
    if not present:
        return {}
    device = input_ids.device
    model = model.get_base_model() if hasattr(model, "get_base_model") else model  # a peft model: its base
    kwargs = {k: v.to(device) for k, v in join_image_tensors([x.tensors for x in present]).items()}
    config = model.config
    image_token = getattr(config, "image_token_id", None)
    if image_token is None:
        image_token = getattr(config, "image_token_index", None)
    forward = inspect.signature(type(model).forward).parameters
    if image_token is not None and "mm_token_type_ids" in forward:
        kwargs["mm_token_type_ids"] = (input_ids == image_token).int()
    elif image_token is not None and "token_type_ids" in forward:  # Gemma 3: attention within an image
        kwargs["token_type_ids"] = (input_ids == image_token).long()
    return kwargs


def join_image_tensors(parts: list[dict]) -> dict:
    """The processor tensors of several prompts' (or one sequence's several processor calls') images as one call
    would give them, in order: Idefics3 / SmolVLM's [1, images, ...] joined along the images (`_cat_images`); per
    image (Gemma 3) or per patch (Qwen) along the first dimension."""
    if "pixel_attention_mask" in parts[0]:
        return {k: _cat_images([p[k] for p in parts]) for k in parts[0]}
    return {k: torch.cat([p[k] for p in parts]) for k in parts[0]}


def _cat_images(parts: list[torch.Tensor]) -> torch.Tensor:
    """[1, n_i, ..., H_i, W_i] tensors -> [1, sum n_i, ..., max H, max W], zero-padded at the bottom and right
    (as the processor pads the images of one call: the pixel mask marks the real pixels; the model matches
    image features to image tokens in order, whatever row they sit in)."""
    h = max(p.shape[-2] for p in parts)
    w = max(p.shape[-1] for p in parts)
    padded = [torch.nn.functional.pad(p, (0, w - p.shape[-1], 0, h - p.shape[-2])) for p in parts]
    return torch.cat(padded, 1)


def has_3d_positions(model) -> bool:
    """Whether `model` (or a peft model's base) computes 3D rotary positions from its images (Qwen's VL models):
    given images, it is then given no position ids."""
    model = model.get_base_model() if hasattr(model, "get_base_model") else model
    return hasattr(getattr(model, "model", None), "get_rope_index")


def rope_deltas(model) -> torch.Tensor | None:
    """[B, 1] the 3D rotary position offset of each row of `model`'s last prefill (Qwen's VL models: the next
    text position is the row's length + delta), or None for a model without 3D positions."""
    inner = getattr(model, "model", None)
    return getattr(inner, "rope_deltas", None) if hasattr(inner, "get_rope_index") else None


VISION_TOWERS = ("visual", "vision_tower", "vision_model")
"""The attribute of a VL model's inner model that holds its vision encoder: Qwen's VL models (`visual`, with its
merger), Gemma 3 and LLaVA (`vision_tower`), Idefics3 / SmolVLM (`vision_model`)."""


def vision_tower(model) -> torch.nn.Module | None:
    """The vision encoder of a vision-language `model`, or None (a text model)."""
    inner = getattr(model, "model", model)
    return next(
        (getattr(inner, a) for a in VISION_TOWERS if isinstance(getattr(inner, a, None), torch.nn.Module)),
        None,
    )


def freeze_vision_tower(model) -> int:
    """Freeze `model`'s vision encoder (`model.freeze_vision`); returns how many parameters it holds."""
    tower = vision_tower(model)
    if tower is None:
        raise ValueError(f"{type(model).__name__} has no vision tower (none of {list(VISION_TOWERS)})")
    tower.requires_grad_(False)
    return sum(p.numel() for p in tower.parameters())


def freeze_language_model(model) -> int:
    """Freeze `model`'s language model: its decoder, input embeddings and output head (`model.freeze_language`),
    leaving the vision tower and the projector as they are; returns how many parameters it holds."""
    if vision_tower(model) is None:
        raise ValueError(f"{type(model).__name__} has no vision tower (none of {list(VISION_TOWERS)})")
    parts = {
        id(m): m for m in (model.get_decoder(), model.get_input_embeddings(), model.get_output_embeddings())
    }
    params = {id(p): p for m in parts.values() if m is not None for p in m.parameters()}
    for p in params.values():
        p.requires_grad_(False)
    return sum(p.numel() for p in params.values())


def copy_processor(path: str | os.PathLike, directory: str | os.PathLike) -> list[str]:
    """Copy the processor's files of the checkpoint at `path` (a local folder) into `directory` (a checkpoint's
    model folder written by a run with images), so that the checkpoint loads with its processor; returns the
    names copied."""
    source = Path(resolve_model(path)[0])
    names = [*PROCESSOR_FILES, "chat_template.jinja", "chat_template.json"]
    copied = [n for n in names if (source / n).is_file()]
    for name in copied:
        shutil.copyfile(source / name, Path(directory) / name)
    return copied
