"""The `look` tool: an environment that shows a picture in its observation (rlkit/envs/images.py).

The question comes without its picture; the model writes `<look/>` and the environment answers with the picture
as an image part of a user message, which the model's processor renders into the next turn's prompt as a data
image would be. A turn without the call ends the episode, whose final answer the reward functions judge. The
picture is the row's `image_key` column when it has one (rlkit's generated pictures, `data.path=pictures` with
`data.image_key=null`, so the prompt itself holds no image); else the environment draws one with PIL from the
row's `shapes` (a list of [shape, colour] pairs, rlkit.data.pictures' shapes and colours), one per quarter.

    env.name=look  data.path=pictures data.image_key=null  env.max_turns=2   (recipes/look_pictures.yaml)
"""

from __future__ import annotations

from rlkit.data import pictures
from rlkit.envs.base import ENVIRONMENTS, Environment

CALL = "<look/>"
ROLES = ("user", "tool")


def draw_shapes(shapes) -> object:
    """A picture of `shapes` ([shape, colour] pairs, at most 4), one per quarter of the canvas at a fixed size."""
    if not isinstance(shapes, list | tuple) or not 1 <= len(shapes) <= 4:
        raise ValueError(f"shapes must be a list of 1 to 4 [shape, colour] pairs, got {shapes!r}"[:200])
    boxes = []
    for quarter, (shape, colour) in enumerate(shapes):
        if shape not in pictures.SHAPES or colour not in pictures.COLOURS:
            raise ValueError(
                f"unknown shape {shape!r} or colour {colour!r}: {pictures.SHAPES}, {list(pictures.COLOURS)}"
            )
        half, m = pictures.SIZE // 2, pictures.MARGIN
        x0, y0 = (quarter % 2) * half + m, (quarter // 2) * half + m
        boxes.append((shape, colour, (x0, y0, x0 + half - 2 * m - 1, y0 + half - 2 * m - 1)))
    return pictures.draw_picture(boxes)


@ENVIRONMENTS.register("look")
class Look(Environment):
    """Shows the row's picture when the model writes `<look/>` (once per episode); ends at a turn without it."""

    images = True
    stop = (CALL,)

    def __init__(self, image_key: str = "image", role: str = "user", text: str = "Here is the picture."):
        """`image_key`: the row's column holding the picture (else the row's `shapes` are drawn). `role`: the chat
        role of the message showing it (the template must know it). `text`: the words after the picture."""
        if role not in ROLES:
            raise ValueError(f"role={role!r} is not one of {list(ROLES)}")
        self.image_key, self.role, self.text = image_key, role, text
        self.picture = None
        self.tool_calls = 0

    def reset(self, row: dict, messages: list[dict]) -> list[dict]:
        if row.get(self.image_key) is not None:
            self.picture = row[self.image_key]
        elif "shapes" in row:
            self.picture = draw_shapes(row["shapes"])
        else:
            raise KeyError(f"the row has neither a {self.image_key!r} column nor `shapes` to draw")
        return messages

    def step(self, text: str) -> tuple[list[dict] | None, float, bool]:
        if CALL not in text or self.tool_calls:
            return None, 0.0, True
        self.tool_calls += 1
        content = [{"type": "image", "image": self.picture}, {"type": "text", "text": self.text}]
        return [{"role": self.role, "content": content}], 0.0, False
