"""Per-row images travel with the rows of the typed batches: select, padding_like and to carry them."""

import pytest
import torch

from rlkit.batch import Images, Sequences, TrainBatch


def _images(tag: str) -> Images:
    return Images(pictures=(tag,), tensors={"pixel_values": torch.full((2, 3), float(len(tag)))}, digest=tag)


def _batch(images, n: int = 0):
    n = n or len(images)
    return TrainBatch(
        prompt_ids=torch.arange(n * 2).view(n, 2),
        prompt_mask=torch.ones(n, 2, dtype=torch.bool),
        response_ids=torch.arange(n * 3).view(n, 3),
        response_mask=torch.ones(n, 3, dtype=torch.bool),
        advantages=torch.zeros(n, 3),
        images=images,
    )


def test_select_carries_each_rows_images():
    a, b = _images("a"), _images("bb")
    batch = _batch((a, a, b, None))
    # picked rows by index list, by tensor, by bool mask and by slice: the images follow the same rows
    assert batch.select([2, 0]).images == (b, a)
    assert batch.select(torch.tensor([3, 1])).images == (None, a)
    assert batch.select(torch.tensor([False, False, True, True])).images == (b, None)
    assert batch.select(slice(1, 3)).images == (a, b)
    assert batch.select([2, 0]).prompt_ids.tolist() == [[4, 5], [0, 1]]


def test_padding_like_and_to_keep_images():
    a = _images("a")
    pad = _batch((a, None)).padding_like(3)
    assert pad.images == (a, a, a) and not pad.response_mask.any()
    moved = _batch((a, None)).to("cpu")
    assert moved.images[1] is None and torch.equal(
        moved.images[0].tensors["pixel_values"], a.tensors["pixel_values"]
    )


def test_a_row_count_that_differs_is_refused():
    with pytest.raises(ValueError, match="images has 1 rows, expected 2"):
        _batch((_images("a"),), n=2)


def test_sequences_of_a_batch_sees_its_images():
    a = _images("a")
    assert Sequences.of(_batch((a, None))).images == (a, None)
    assert Sequences.of(_batch(None, 2)).images is None
