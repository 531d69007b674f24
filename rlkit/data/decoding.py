"""Decoding one image value (a path, bytes, a PIL image, a `datasets` Image feature) into an RGB PIL image under the
size rule (`data.max_image_pixels`, `data.resize_images`): the rule of a dataset's images (rlkit/data/images.py) and
of the images an environment shows (rlkit/envs/images.py, run in its worker process). PIL only, no torch: an
environment worker imports it without the trainer's heavy packages."""

from __future__ import annotations

import io
import re
from pathlib import Path

_BUFFER = re.compile(r"<_io\.BytesIO object at 0x[0-9a-fA-F]+>")


class ImageError(ValueError):
    """An image that cannot be used (the message names where it comes from and the value)."""


def open_picture(value, *, max_pixels: int, resize: bool, where: str, base: Path | None = None):
    """One image value (a path, bytes, a PIL image, a `datasets` Image feature) -> an RGB PIL image of at most
    `max_pixels` (resized down to it, aspect kept, when `resize`, else refused): ImageError starting with
    `where` on a value that is not an image or is too big. The rule of data images (`decode`) and of the images
    an environment shows (rlkit.envs.images)."""
    from PIL import Image

    picture = value
    try:
        if isinstance(value, dict):  # a datasets Image feature, not decoded
            picture = value.get("bytes") or value.get("path")
        if isinstance(picture, str | Path):
            path = Path(picture).expanduser()
            if not path.is_absolute() and not path.exists() and base is not None:
                path = base / path
            picture = Image.open(path)
        elif isinstance(picture, bytes | bytearray):
            picture = Image.open(io.BytesIO(picture))
        if not isinstance(picture, Image.Image):
            raise TypeError(f"not an image: a {type(picture).__name__}")
        picture.load()
        picture = picture.convert("RGB")
    except Exception as e:  # PIL raises many kinds (UnidentifiedImageError, OSError, ...)
        why = _BUFFER.sub("the bytes", str(e))  # PIL names its buffer by address: one reason for equal bytes
        raise ImageError(f"{where}: cannot decode the image ({type(e).__name__}: {why})") from e
    pixels = picture.width * picture.height
    if pixels > max_pixels:
        if not resize:
            raise ImageError(
                f"{where}: the image is {picture.width}x{picture.height} = {pixels} pixels, over "
                f"data.max_image_pixels={max_pixels} (data.resize_images=true resizes it down)"
            )
        scale = (max_pixels / pixels) ** 0.5
        size = (max(1, int(picture.width * scale)), max(1, int(picture.height * scale)))
        picture = picture.resize(size, Image.Resampling.BICUBIC)
    return picture
