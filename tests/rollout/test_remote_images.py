"""Images on the async path (issue 58): a batch's per-row images and the probe's pictures travel in the messages
between the learner and the rollout workers (pixels as uint8 tensors, never pickled) and in the pending-batches
file, and the learner's merge of the workers' shares and its split over ranks keep each row's images."""

import dataclasses

import pytest
import torch
from test_messages import same, scored

from rlkit.batch import Images
from rlkit.rollout.remote.messages import (
    MESSAGES,
    BatchShare,
    Digests,
    MessageError,
    Pending,
    decode,
    dumps,
    load_pending,
    loads,
    save_pending,
)
from rlkit.rollout.scored import merge_scored, split_scored


def _picture(seed: int, size=(7, 5)):
    from PIL import Image

    g = torch.Generator().manual_seed(seed)
    return Image.fromarray(
        torch.randint(0, 256, (size[1], size[0], 3), generator=g, dtype=torch.uint8).numpy()
    )


def _images(seed: int) -> Images:
    return Images(
        pictures=(_picture(seed), _picture(seed + 1, (4, 4))),
        tensors={
            "pixel_values": torch.randn(2, 3, 4, 4),
            "pixel_attention_mask": torch.ones(2, 4, 4, dtype=torch.bool),
        },
        digest=f"d{seed}",
    )


def _with_images(version=3):
    """The test batch (2 groups of 2) with group 0's prompt showing two pictures and group 1's none."""
    sb = scored(version)
    a = _images(1)
    return dataclasses.replace(sb, rollout=dataclasses.replace(sb.rollout, images=(a, a, None, None)))


def _same_images(a, b) -> bool:
    if a is None or b is None:
        return a is b
    return (
        a.digest == b.digest
        and [p.tobytes() for p in a.pictures] == [p.tobytes() for p in b.pictures]
        and [p.size for p in a.pictures] == [p.size for p in b.pictures]
        and same(a.tensors, b.tensors)
    )


def test_a_batch_share_with_images_round_trips():
    sb = _with_images()
    back = loads(dumps(BatchShare(worker=0, index=1, batch=sb, position=8, seconds={})), MESSAGES)
    got = back.batch.rollout.images
    assert len(got) == 4 and all(_same_images(x, y) for x, y in zip(sb.rollout.images, got))
    assert same(
        dataclasses.replace(back.batch.rollout, images=None), dataclasses.replace(sb.rollout, images=None)
    )


def test_the_probes_pictures_travel_with_the_digests():
    images = (_images(5), _images(7))
    msg = Digests(
        version=2,
        digests={"w": "0"},
        probe=torch.zeros(2, 3),
        probe_tokens=torch.ones(2, 4),
        probe_images=images,
    )
    back = loads(dumps(msg), MESSAGES)
    assert all(_same_images(x, y) for x, y in zip(images, back.probe_images))


def test_pending_batches_with_images_round_trip_through_the_file(tmp_path):
    items = [Pending(index=0, batch=_with_images(), position=4, seconds={"timing/generate_s": 1.0})]
    save_pending(tmp_path / "p.safetensors", items)
    (back,) = load_pending(tmp_path / "p.safetensors")
    assert all(_same_images(x, y) for x, y in zip(items[0].batch.rollout.images, back.batch.rollout.images))


def test_a_crafted_picture_is_refused():
    for pixels in (torch.zeros(2, 2, 3), torch.zeros(2, 2, dtype=torch.uint8), "x"):
        with pytest.raises(MessageError, match=r"a picture must be \[H, W, 3\] uint8 pixels"):
            decode({"__picture__": pixels})


def test_merge_and_split_keep_each_rows_images():
    """Two workers' shares, the first with images and the second without: the merged batch's rows carry theirs
    (None on the second share's rows), and the split over two ranks gives each its groups' images."""
    first, second = _with_images(), scored()
    merged = merge_scored([first, second])
    a = first.rollout.images[0]
    assert merged.rollout.images == (a, a, None, None, None, None, None, None)
    shares = split_scored(merged, 2)
    assert shares[0].rollout.images == (a, a, None, None) and shares[1].rollout.images == (None,) * 4
    assert merge_scored([second, scored()]).rollout.images is None
