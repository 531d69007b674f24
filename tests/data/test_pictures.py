"""The generated picture tasks (rlkit/data/pictures.py): every answer is read back from the pixels alone, by a
flood fill and channel comparisons written here, not by the generator's own bookkeeping."""

import io

import numpy as np
import pytest
from PIL import Image

from rlkit.config.schema import ConfigError, DataConfig, RLConfig
from rlkit.data import pictures
from rlkit.data.loading import check_config, load_splits
from rlkit.rewards.functions import exact_reward, math_reward


def _regions(pixels: np.ndarray) -> list[list[tuple[int, int]]]:
    """4-connected regions of non-white pixels, by a plain flood fill."""
    ink = (pixels != 255).any(axis=2)
    seen = np.zeros_like(ink)
    regions = []
    for y, x in zip(*np.nonzero(ink)):
        if seen[y, x]:
            continue
        stack, region = [(y, x)], []
        seen[y, x] = True
        while stack:
            cy, cx = stack.pop()
            region.append((cy, cx))
            for ny, nx in ((cy + 1, cx), (cy - 1, cx), (cy, cx + 1), (cy, cx - 1)):
                if 0 <= ny < ink.shape[0] and 0 <= nx < ink.shape[1] and ink[ny, nx] and not seen[ny, nx]:
                    seen[ny, nx] = True
                    stack.append((ny, nx))
        regions.append(region)
    return regions


def _colour_name(rgb) -> str:
    """The colour of a pixel by which channels are high (> 150) and low (< 100)."""
    high = tuple(int(c) > 150 for c in rgb)
    low = tuple(int(c) < 100 for c in rgb)
    if high == (True, False, False) and low[1:] == (True, True):
        return "red"
    if high == (False, True, False) and low[0] and low[2]:
        return "green"
    if high == (False, False, True) and low[:2] == (True, True):
        return "blue"
    if high == (True, True, False) and low[2]:
        return "yellow"
    return f"unknown {tuple(rgb)}"


def _pixels(image_bytes: bytes) -> np.ndarray:
    image = Image.open(io.BytesIO(image_bytes))
    assert image.size == (64, 64) and image.mode == "RGB"
    return np.asarray(image)


def test_count_answers_are_the_connected_regions_in_the_pixels():
    rows = pictures.picture_rows(200, seed=1, kinds=("count",))
    counts = []
    for row in rows:
        regions = _regions(_pixels(row["image"]))
        assert row["question"] == "How many shapes are in the picture?"
        assert row["answer"] == str(len(regions))
        assert all(len(r) >= 50 for r in regions)  # a shape, not a stray pixel
        counts.append(len(regions))
    assert set(counts) == {1, 2, 3, 4}
    assert min(counts.count(n) for n in range(1, 5)) > 30  # roughly balanced classes


def test_colour_answers_are_the_colour_of_the_pixels():
    rows = pictures.picture_rows(120, seed=2, kinds=("colour",))
    for row in rows:
        pixels = _pixels(row["image"])
        (region,) = _regions(pixels)
        names = {_colour_name(pixels[y, x]) for y, x in region}
        assert names == {row["answer"]}, names
    assert {r["answer"] for r in rows} == {"red", "green", "blue", "yellow"}


def test_deterministic_distinct_and_mixed_kinds():
    a = pictures.picture_rows(60, seed=3, kinds=("count", "colour"))
    b = pictures.picture_rows(60, seed=3, kinds=("count", "colour"))
    assert a == b
    assert a != pictures.picture_rows(60, seed=4, kinds=("count", "colour"))
    assert len({r["image"] for r in a}) == 60
    assert {r["kind"] for r in a} == {"count", "colour"}
    with pytest.raises(ValueError, match=r"data.picture_kinds=\['size'\] must be a non-empty subset of"):
        pictures.picture_rows(4, kinds=("size",))


def test_load_splits_holds_out_pictures_and_decodes_them(tmp_path, monkeypatch):
    monkeypatch.setenv("RLKIT_CACHE", str(tmp_path / "cache"))
    cfg = DataConfig(path="pictures", subset=None, num_train=80, num_eval=20, eval_size=16)
    train, ev = load_splits(cfg)
    assert len(train) == 80 and len(ev) == 16
    image = train[0]["image"]
    assert isinstance(image, Image.Image) and image.size == (64, 64)
    # no held-out picture is a training picture (compared by pixels)
    seen = {img.tobytes() for img in train["image"]}
    assert not seen & {img.tobytes() for img in ev["image"]}
    for row in list(ev)[:8]:  # the decoded rows keep their answers
        assert row["answer"] == str(len(_regions(np.asarray(row["image"].convert("RGB")))))


def test_rewards_check_the_answers():
    assert math_reward("", "3", "3") == 1.0 and math_reward("", "There are 2 shapes.", "3") == 0.0
    assert exact_reward("", "Red.", "red") == exact_reward("", "The shape is red", "red") == 1.0
    assert exact_reward("", "blue", "red") == exact_reward("", "", "red") == 0.0
    assert exact_reward("", "red or blue", "red") == 0.0  # the last word answers


def _cfg(kinds, reward="math", route_by=None):
    cfg = RLConfig()
    cfg.data.path, cfg.data.picture_kinds = "pictures", kinds
    cfg.reward.fn, cfg.reward.route_by = reward, route_by
    return cfg


def test_config_checks_kinds_and_their_reward():
    check_config(_cfg(["count"]))
    check_config(_cfg(["colour"], "exact"))
    check_config(_cfg(["count", "colour"], route_by="kind"))
    with pytest.raises(ConfigError, match=r"data.picture_kinds=\['shade'\] must be a non-empty subset of"):
        check_config(_cfg(["shade"]))
    with pytest.raises(ConfigError, match=r"checked by the reward\(s\) \['exact'\], not reward.fn='math'"):
        check_config(_cfg(["colour"]))
