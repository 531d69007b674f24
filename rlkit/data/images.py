"""Images of a dataset row for a vision-language model (`data.image_key`): decoding, the size rule, and the
prompt rendered through the model's processor into expanded token ids and one `rlkit.batch.Images`.

A row's image value is a path, bytes, a PIL image, a `datasets` Image feature (decoded: a PIL image; not decoded:
{"bytes", "path"}), or a list of those. Every failure is a start-up error naming the key, the row and the value.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import torch

from rlkit.batch import Images
from rlkit.config.schema import DataConfig
from rlkit.data.decoding import ImageError, open_picture
from rlkit.vision import join_image_tensors

PLACEHOLDER = "<image>"
"""Where a question places its images; a question without one gets its images before the text."""

# Processor outputs that run along the token ids (one value per prompt token), not image tensors.
TOKEN_KEYS = ("input_ids", "attention_mask", "mm_token_type_ids", "token_type_ids")


def _where(cfg: DataConfig, row: int, value) -> str:
    shown = repr(value) if not isinstance(value, bytes | bytearray) else f"<{len(value)} bytes>"
    return f"data.image_key={cfg.image_key!r}, row {row}, value {shown[:120]}"


def decode(value, cfg: DataConfig, row: int, base: Path | None = None):
    """One image value -> an RGB PIL image of at most `cfg.max_image_pixels` (resized down to it with
    `cfg.resize_images`, else refused)."""
    where = _where(cfg, row, value)
    return open_picture(
        value, max_pixels=cfg.max_image_pixels, resize=cfg.resize_images, where=where, base=base
    )


def row_pictures(value, cfg: DataConfig, row: int, base: Path | None = None) -> list:
    """A row's image value (one image or a list of them; None or [] for none) -> its PIL images."""
    if value is None:
        return []
    values = value if isinstance(value, list | tuple) else [value]
    return [decode(v, cfg, row, base) for v in values]


def column_pictures(row: dict, cfg: DataConfig, number: int) -> tuple[object, list]:
    """(the value of row `number`'s data.image_key column, its PIL images); a relative path is looked up beside a
    local data.path. A row without the column raises ValueError naming the key and the columns."""
    if cfg.image_key not in row:
        raise ValueError(
            f"data.image_key={cfg.image_key!r} is not a column of the data (columns: {sorted(row)})"
        )
    value = row[cfg.image_key]
    local = Path(cfg.path).expanduser()
    base = (local if local.is_dir() else local.parent) if local.exists() else None
    return value, row_pictures(value, cfg, number, base)


def digest(pictures) -> str:
    """sha256 over the pictures' sizes and RGB pixels (Images.digest)."""
    h = hashlib.sha256()
    for p in pictures:
        h.update(f"{p.width}x{p.height};".encode())
        h.update(p.tobytes())
    return h.hexdigest()


def vl_messages(messages: list[dict], count: int, cfg: DataConfig, row: int, value) -> list[dict]:
    """The chat messages (`rlkit.data.prompts.prompt_messages`) with the last user message's content as a list of
    image and text items: an image at each `<image>` of the question, else all `count` images before it."""
    user = messages[-1]["content"]
    marks = user.count(PLACEHOLDER)
    if marks and marks != count:
        raise ImageError(
            f"{_where(cfg, row, value)}: {count} image(s) but {marks} {PLACEHOLDER} placeholder(s) in the question "
            f"(data.prompt_key={cfg.prompt_key!r}): one placeholder per image, or none"
        )
    if not marks:
        content = [{"type": "image"}] * count + [{"type": "text", "text": user}]
    else:
        content = []
        for i, part in enumerate(user.split(PLACEHOLDER)):
            if i:
                content.append({"type": "image"})
            if part:
                content.append({"type": "text", "text": part})
    return [*messages[:-1], {"role": "user", "content": content}]


def render_with_images(messages: list[dict], pictures: list, processor, cfg: DataConfig, row: int, value):
    """(prompt text, expanded token ids, Images or None) of one prompt through the model's processor: the chat
    template with one placeholder per picture, then the processor's expansion of each placeholder to the image's
    count of tokens."""
    chat = vl_messages(messages, len(pictures), cfg, row, value)
    text = processor.apply_chat_template(chat, add_generation_prompt=True, tokenize=False)
    if not pictures:
        return text, processor.tokenizer(text, add_special_tokens=False).input_ids, None
    try:
        return (text, *expand(processor, text, pictures))
    except ValueError as e:  # the processor's own count check (placeholders vs images)
        raise ImageError(f"{_where(cfg, row, value)}: the processor refused the prompt: {e}") from e


def expand(processor, text: str, pictures: list) -> tuple[list[int], Images]:
    """(token ids, Images) of `text` whose placeholders (one per picture, in order) the processor expands to each
    picture's image tokens; the processor's image tensors for these pictures alone."""
    out = processor(text=[text], images=list(pictures), return_tensors="pt", add_special_tokens=False)
    ids = out["input_ids"][0].tolist()
    tensors = {k: v for k, v in out.items() if k not in TOKEN_KEYS and isinstance(v, torch.Tensor)}
    return ids, Images(tuple(pictures), tensors, digest(pictures))


def join_images(first: Images | None, then: Images) -> Images:
    """The Images of a sequence holding `first`'s pictures, then `then`'s (an episode whose environment showed
    pictures): the pictures in order, each processor tensor joined as the model's forward takes several prompts'
    (`rlkit.vision.join_image_tensors`), the digest over all the pictures."""
    if first is None:
        return then
    pictures = (*first.pictures, *then.pictures)
    return Images(pictures, join_image_tensors([first.tensors, then.tensors]), digest(pictures))
