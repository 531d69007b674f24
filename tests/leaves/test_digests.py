"""The on-device digest of rlkit/digests.py against a naive Python loop, and what it must tell apart: every
single-element change (a bit flip at every position), two swapped rows (which a plain sum of the elements cannot
see), and a tensor assembled from pieces (the sum of the pieces' contributions at their positions)."""

import struct

import pytest
import torch

from rlkit.digests import digest, range_digest, tensor_digest, to_host

MASK = (1 << 64) - 1


def naive(values: list[float], fmt: str, start: int = 0) -> int:
    """The digest's definition, element by element, in Python integers modulo 2**64."""

    def fmix(x):
        x ^= x >> 33
        x = (x * 0xFF51AFD7ED558CCD) & MASK
        x ^= x >> 33
        x = (x * 0xC4CEB9FE1A85EC53) & MASK
        return x ^ (x >> 33)

    size = struct.calcsize(fmt)
    total = 0
    for p, v in enumerate(values):
        v = 0.0 if v == 0 else v  # -0.0 reads as +0.0
        bits = int.from_bytes(struct.pack("<" + fmt, v), "little", signed=True) if size else 0
        total += fmix((bits + (start + p) * 0x9E3779B97F4A7C15) & MASK)
    return total & MASK


def test_the_digest_is_the_naive_loops_in_fp32_and_fp64():
    g = torch.Generator().manual_seed(0)
    for dtype, fmt in ((torch.float32, "f"), (torch.float64, "d")):
        t = torch.randn(7, 5, generator=g, dtype=dtype)
        t[0, 0] = -0.0
        assert int(digest(t), 16) == naive(t.flatten().tolist(), fmt)
        assert int(to_host({"x": range_digest(t[1:], 5)})["x"], 16) == naive(t[1:].flatten().tolist(), fmt, 5)


def test_minus_zero_and_plus_zero_are_the_same_value():
    assert digest(torch.tensor([0.0, 1.0])) == digest(torch.tensor([-0.0, 1.0]))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_every_single_bit_flip_at_every_position_changes_the_digest(dtype):
    g = torch.Generator().manual_seed(1)
    t = torch.randn(6, 4, generator=g).to(dtype)
    base = digest(t)
    width = {torch.float32: torch.int32, torch.bfloat16: torch.int16}[dtype]
    bits = t.view(width).flatten()
    for p in range(bits.numel()):
        for b in range(t.element_size() * 8 - 1):  # every bit but the sign (a sign flip of 0.0 is no change)
            flipped = bits.clone()
            flipped[p] ^= 1 << b
            assert digest(flipped.view(dtype).view(t.shape)) != base, (p, b)


def test_two_swapped_rows_change_the_digest_where_a_plain_sum_does_not():
    g = torch.Generator().manual_seed(2)
    emb = torch.randn(64, 8, generator=g)
    swapped = emb.clone()
    swapped[[40, 41]] = emb[[41, 40]]
    plain = lambda t: int(t.view(torch.int32).to(torch.int64).sum())  # noqa: E731
    assert plain(swapped) == plain(emb)  # what a naive sum would say: nothing changed
    assert digest(swapped) != digest(emb)


def test_a_stacked_tensor_is_the_sum_of_its_pieces_at_their_offsets():
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(n, 4, generator=g) for n in (8, 2, 2))
    whole = tensor_digest(torch.cat([q, k, v]))
    parts = range_digest(q, 0) + range_digest(k, q.numel()) + range_digest(v, q.numel() + k.numel())
    assert to_host({"a": whole}) == to_host({"a": parts})
    assert to_host({"a": whole}) != to_host(
        {"a": range_digest(k, 0) + range_digest(q, k.numel()) + range_digest(v, 40)}
    )


def test_chunks_give_the_same_digest(monkeypatch):
    t = torch.randn(1000)
    whole = digest(t)
    monkeypatch.setattr("rlkit.digests.CHUNK", 7)
    assert digest(t) == whole
