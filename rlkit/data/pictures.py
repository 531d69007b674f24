"""The generated picture tasks (`data.path=pictures`): small images rlkit draws itself, for a vision-language
model to learn to see offline.

Each row is a 64x64 RGB picture of flat shapes on a white background, a question and its answer:

    count    "How many shapes are in the picture?"  1 to 4 shapes, one per quarter of the canvas   -> "3"
    colour   "What colour is the shape?"             one shape, red / green / blue / yellow         -> "red"

Shapes (circle, square, triangle) are drawn without anti-aliasing in a palette of four saturated colours and
never touch (each lies inside its own quarter, a margin from its edges), so the answer can be read back from
the pixels alone: the number of connected non-white regions, or the colour of the non-white pixels
(tests/data/test_pictures.py does exactly that). `count` answers are numbers, scored by the `math` reward;
`colour` answers are words, scored by the `exact` reward.

The set is a pure function of (num_train, num_eval, seed, kinds), written once under the cache as
`train.parquet` / `test.parquet` with the picture as a `datasets` Image feature (PNG bytes) in column `image`:
no held-out picture is also a training picture (pictures are compared by their pixels).
"""

from __future__ import annotations

import hashlib
import io
import random
import shutil
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

PICTURES = "pictures"
"""data.path=pictures: this generated set."""
IMAGE_KEY = "image"
"""The column holding the picture."""
SIZE = 64
"""Width and height of a picture, in pixels."""
BACKGROUND = (255, 255, 255)
COLOURS = {"red": (220, 30, 30), "green": (30, 160, 50), "blue": (30, 70, 220), "yellow": (235, 200, 20)}
SHAPES = ("circle", "square", "triangle")
MARGIN = 3
"""Pixels between a shape and the edges of its quarter: shapes in different quarters never touch."""
MIN_SIDE, MAX_SIDE = 14, SIZE // 2 - 2 * MARGIN
"""A shape's bounding box side, in pixels (26 at most: inside its 32-pixel quarter with the margins)."""


@dataclass(frozen=True)
class Kind:
    """A picture task: `build(rng) -> (PIL image, question, answer)`."""

    build: Callable[[random.Random], tuple[object, str, str]]
    reward: str
    """The reward that checks its answers (`reward.fn`)."""


KINDS: dict[str, Kind] = {}
DEFAULT_KINDS = ("count",)


def kind(name: str, *, reward: str):
    """Register a picture task (`data.picture_kinds` takes its name)."""

    def register(build):
        KINDS[name] = Kind(build, reward)
        return build

    return register


def _draw_shape(draw, shape: str, box: tuple[int, int, int, int], colour: tuple[int, int, int]) -> None:
    x0, y0, x1, y1 = box
    if shape == "circle":
        draw.ellipse(box, fill=colour)
    elif shape == "square":
        draw.rectangle(box, fill=colour)
    else:
        draw.polygon([((x0 + x1) // 2, y0), (x0, y1), (x1, y1)], fill=colour)


def _box_in_quarter(rng: random.Random, quarter: int) -> tuple[int, int, int, int]:
    """A random square box inside quarter 0..3 (row-major) of the canvas, MARGIN from its edges."""
    side = rng.randint(MIN_SIDE, MAX_SIDE)
    qx, qy = (quarter % 2) * (SIZE // 2), (quarter // 2) * (SIZE // 2)
    x0 = qx + rng.randint(MARGIN, SIZE // 2 - MARGIN - side)
    y0 = qy + rng.randint(MARGIN, SIZE // 2 - MARGIN - side)
    return x0, y0, x0 + side - 1, y0 + side - 1


def draw_picture(shapes: list[tuple[str, str, tuple[int, int, int, int]]]):
    """A SIZE x SIZE RGB PIL image of `shapes`, each (shape, colour name, box)."""
    from PIL import Image, ImageDraw

    image = Image.new("RGB", (SIZE, SIZE), BACKGROUND)
    draw = ImageDraw.Draw(image)
    for shape, colour, box in shapes:
        _draw_shape(draw, shape, box, COLOURS[colour])
    return image


@kind("count", reward="math")
def _count(rng: random.Random):
    n = rng.randint(1, 4)
    quarters = rng.sample(range(4), n)
    shapes = [(rng.choice(SHAPES), rng.choice(list(COLOURS)), _box_in_quarter(rng, q)) for q in quarters]
    return draw_picture(shapes), "How many shapes are in the picture?", str(n)


@kind("colour", reward="exact")
def _colour(rng: random.Random):
    colour = rng.choice(list(COLOURS))
    shapes = [(rng.choice(SHAPES), colour, _box_in_quarter(rng, rng.randrange(4)))]
    return draw_picture(shapes), "What colour is the shape?", colour


def check_kinds(kinds) -> None:
    """`data.picture_kinds` must be a non-empty list of registered kinds (raises ValueError)."""
    if not kinds or any(k not in KINDS for k in kinds):
        raise ValueError(f"data.picture_kinds={list(kinds)} must be a non-empty subset of {list(KINDS)}")


def rewards_of(kinds) -> set[str]:
    """The rewards that check the answers of `kinds`."""
    return {KINDS[k].reward for k in kinds}


def png_bytes(image) -> bytes:
    buf = io.BytesIO()
    image.save(buf, format="PNG", optimize=False)
    return buf.getvalue()


def picture_rows(num_rows: int, *, seed: int = 0, kinds: tuple[str, ...] = DEFAULT_KINDS) -> list[dict]:
    """`num_rows` rows {question, answer, kind, image: PNG bytes} of distinct pictures, kinds drawn in turn at
    random from `kinds`; a pure function of its arguments. ValueError when the pictures run out."""
    check_kinds(kinds)
    rng = random.Random(seed)
    seen: set[str] = set()
    rows: list[dict] = []
    for _ in range(50 * num_rows):
        if len(rows) == num_rows:
            break
        name = rng.choice(kinds)
        image, question, answer = KINDS[name].build(rng)
        digest = hashlib.sha256(image.tobytes()).hexdigest()
        if digest not in seen:
            seen.add(digest)
            rows.append({"question": question, "answer": answer, "kind": name, IMAGE_KEY: png_bytes(image)})
    if len(rows) < num_rows:
        raise ValueError(f"data.num_train + data.num_eval = {num_rows} exceeds the distinct pictures drawn")
    return rows


def cache_name(num_train: int, num_eval: int, kinds) -> str:
    return f"pictures-v1-{num_train}-{num_eval}-{'-'.join(kinds)}"


def generate_pictures(
    directory: str | Path, *, num_train: int, num_eval: int, seed: int = 0, kinds=DEFAULT_KINDS
) -> Path:
    """Write `train.parquet` and `test.parquet` of picture rows into `directory` (atomically: a temporary folder
    renamed into place); an existing set is kept. The first `num_eval` rows drawn are the test split."""
    import datasets

    directory = Path(directory)
    if (directory / "train.parquet").exists() and (directory / "test.parquet").exists():
        return directory
    rows = picture_rows(num_train + num_eval, seed=seed, kinds=tuple(kinds))
    features = datasets.Features(
        {
            "question": datasets.Value("string"),
            "answer": datasets.Value("string"),
            "kind": datasets.Value("string"),
            IMAGE_KEY: datasets.Image(),
        }
    )
    directory.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=directory.parent, prefix=f".tmp-{directory.name}-"))
    for name, part in (("test.parquet", rows[:num_eval]), ("train.parquet", rows[num_eval:])):
        cols = {k: [r[k] for r in part] for k in features}
        cols[IMAGE_KEY] = [{"bytes": b, "path": None} for b in cols[IMAGE_KEY]]
        datasets.Dataset.from_dict(cols, features=features).to_parquet(str(tmp / name))
    try:
        tmp.rename(directory)
    except OSError:  # another process won the race; its copy is identical
        shutil.rmtree(tmp, ignore_errors=True)
    return directory
