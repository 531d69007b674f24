"""Images an environment shows: an observation message whose content is a list of parts,

    {"role": "tool", "content": [{"type": "image", "image": <a PIL image, PNG/JPEG bytes or a path>},
                                 {"type": "text", "text": "The plot of f."}]}

enters the next turn's prompt as a data image does (rlkit/data/images.py): decoded by the same rules
(`data.max_image_pixels`, `data.resize_images`), placed at its part by the model's processor, its image tokens
counted in the episode's token budget. An environment that shows images says so (`Environment.images = True`):
the run then loads the vision-language model whole, with its processor.

The picture is decoded in the environment's worker process (a malformed or oversized image fails that step
there, with the reason, never the trainer) and crosses the pipe as its RGB pixels (`Pixels`: sizes and bytes,
never a PIL object); the trainer rebuilds it after checking the sizes against the bytes.
"""

from __future__ import annotations

from dataclasses import dataclass

from rlkit.data.decoding import open_picture

MAX_PICTURES = 16
"""Most pictures in one observation; more is a malformed observation."""


@dataclass(frozen=True)
class PictureRule:
    """How the images of an observation are decoded (from `data.*`): at most `max_pixels` pixels each, resized
    down to it when `resize`, else refused."""

    max_pixels: int
    resize: bool


@dataclass(frozen=True)
class Pixels:
    """A decoded picture as it crosses from an environment worker: width, height and the RGB bytes."""

    width: int
    height: int
    rgb: bytes

    @classmethod
    def of(cls, picture) -> Pixels:
        return cls(picture.width, picture.height, picture.tobytes())

    def picture(self):
        """The RGB PIL image (ValueError when the bytes do not fit the sizes)."""
        from PIL import Image

        w, h = self.width, self.height
        if not (
            isinstance(w, int) and isinstance(h, int) and w > 0 and h > 0 and isinstance(self.rgb, bytes)
        ):
            raise ValueError(f"a picture must have positive int sizes and bytes, got {w!r} x {h!r}")
        if len(self.rgb) != 3 * w * h:
            raise ValueError(f"a {w}x{h} picture needs {3 * w * h} RGB bytes, got {len(self.rgb)}")
        return Image.frombytes("RGB", (w, h), self.rgb)


def check_parts(content, what: str, rule: PictureRule | None) -> list[dict]:
    """A message's content given as a list of parts, checked: text parts `{"type": "text", "text": str}` and
    image parts `{"type": "image", "image": value}`, each image decoded by `rule` into `Pixels` (raises TypeError
    or ValueError naming the part; an image when `rule` is None, a run without images, is refused)."""
    out = []
    for k, part in enumerate(content):
        where = f"{what}[{k}]"
        kind = part.get("type") if isinstance(part, dict) else None
        if kind == "text" and isinstance(part.get("text"), str):
            out.append({"type": "text", "text": part["text"]})
        elif kind == "image":
            if rule is None:
                raise ValueError(
                    f"{where} is an image, but this run takes none from its environment (an environment whose "
                    "observations show images sets `images = True`, with a vision-language model.path)"
                )
            if "image" not in part:
                raise TypeError(f"{where} must hold its picture under 'image' (a PIL image, bytes or a path)")
            picture = open_picture(part["image"], max_pixels=rule.max_pixels, resize=rule.resize, where=where)
            out.append({"type": "image", "image": Pixels.of(picture)})
        else:
            raise TypeError(
                f"{where} must be {{'type': 'text', 'text': str}} or {{'type': 'image', 'image': ...}}, got "
                f"{part if not isinstance(part, dict) else {key: type(v).__name__ for key, v in part.items()}!r}"[
                    :300
                ]
            )
    if sum(p["type"] == "image" for p in out) > MAX_PICTURES:
        raise ValueError(f"{what} holds more than {MAX_PICTURES} images")
    return out


def text_chars(content) -> int:
    """The characters of a message's content (a string, or the text of its parts)."""
    if isinstance(content, str):
        return len(content)
    return sum(len(p["text"]) for p in content if p["type"] == "text")


def has_pictures(messages: list[dict]) -> bool:
    return any(not isinstance(m["content"], str) for m in messages)


def template_messages(messages: list[dict]) -> tuple[list[dict], list]:
    """(the messages as a chat template takes them: an image part as `{"type": "image"}`, the placeholder the
    processor expands; their pictures in order, as PIL images). Raises ValueError on a malformed `Pixels`."""
    shown, pictures = [], []
    for m in messages:
        if isinstance(m["content"], str):
            shown.append(m)
            continue
        parts = []
        for p in m["content"]:
            if p["type"] == "image":
                pixels = p["image"]
                if not isinstance(pixels, Pixels):
                    raise ValueError(f"an image part holds a {type(pixels).__name__}, not Pixels")
                pictures.append(pixels.picture())
                parts.append({"type": "image"})
            else:
                parts.append(p)
        shown.append({**m, "content": parts})
    return shown, pictures
