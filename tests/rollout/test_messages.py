"""The async messages and their tensors-only encoding (rlkit/rollout/remote/messages.py): every message
type round-trips, nothing else is accepted, and neither a crafted queue message nor a crafted pending file
runs code when read."""

import dataclasses
import io

import pytest
import torch

from rlkit.batch import RolloutBatch, ScoredBatch
from rlkit.rollout.remote.messages import (
    MAX_TRACEBACK_CHARS,
    MESSAGES,
    TO_LEARNER,
    TO_WORKER,
    BatchShare,
    EvalResult,
    Grant,
    MessageError,
    Pending,
    Push,
    Ready,
    Stop,
    WorkerError,
    dumps,
    load_pending,
    loads,
    save_pending,
    worker_error,
)


def scored(version=3) -> ScoredBatch:
    n, t = 4, 3
    rollout = RolloutBatch(
        prompt_ids=torch.arange(n * 2).view(n, 2),
        prompt_mask=torch.ones(n, 2, dtype=torch.bool),
        response_ids=torch.arange(n * t).view(n, t),
        response_mask=torch.tensor([[1, 1, 0]] * n, dtype=torch.bool),
        rollout_logprobs=torch.full((n, t), -0.5),
        finish_reasons=("stop", "length", "stop", "stop"),
        group_index=torch.tensor([0, 0, 1, 1]),
        group_size=2,
        response_texts=("a", "b", "c", "é"),
        stats={"gen_tokens": 8.0},
    )
    rewards = torch.tensor([1.0, 0.0, 0.5, 1.0])
    return ScoredBatch(
        rollout=rollout, rewards=rewards, correct=torch.tensor([1.0, 0.0, 0.0, 1.0]),
        per_fn={"fn": rewards}, errors=1, timeouts=0, stats={"dynamic/kept_frac": 0.5},
        policy_version=version, env_stats={"turns": torch.ones(n)},
    )  # fmt: skip


def same(a, b):
    """Dataclasses, dicts, tuples and tensors equal field by field (tensors by value and dtype)."""
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if dataclasses.is_dataclass(a):
        return type(a) is type(b) and all(
            same(getattr(a, f.name), getattr(b, f.name)) for f in dataclasses.fields(a)
        )
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, (tuple, list)):
        return type(a) is type(b) and len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    return type(a) is type(b) and a == b


EXAMPLES = [
    Push(version=2, evaluate=True, grant=1, manifest={"w": (4, 3), "b": (4,)}),
    Grant(count=2),
    Stop(),
    Ready(worker=1),
    BatchShare(worker=0, index=5, batch=scored(), position=40, seconds={"timing/generate_s": 1.5}),
    EvalResult(worker=0, version=2, metrics={"eval/pass@1": 0.25}),
    WorkerError(worker=1, traceback="Traceback (most recent call last):\n  boom"),
]


@pytest.mark.parametrize("msg", EXAMPLES, ids=lambda m: type(m).__name__)
def test_every_message_round_trips(msg):
    back = loads(dumps(msg), MESSAGES)
    assert same(msg, back)
    for side in (TO_WORKER, TO_LEARNER):
        if not isinstance(msg, side):
            with pytest.raises(MessageError, match=f"refused a message of type {type(msg).__name__}"):
                loads(dumps(msg), side)


def test_a_long_traceback_is_cut_in_the_middle_to_fit_an_empty_pipe():
    text = "Traceback (most recent call last):\n" + "x" * 100_000 + "\nRuntimeError: the end"
    err = worker_error(3, text)
    assert err.worker == 3 and len(err.traceback) < MAX_TRACEBACK_CHARS + 100
    assert err.traceback.startswith("Traceback") and err.traceback.endswith("RuntimeError: the end")
    assert f"[{len(text) - MAX_TRACEBACK_CHARS} characters cut]" in err.traceback
    # Even all in 4-byte characters it fits a pipe's 64 KiB, encoding included.
    assert len(dumps(worker_error(0, "\U0001f600" * 50_000))) < 64 * 1024
    assert worker_error(0, "short").traceback == "short"


def test_a_message_for_the_other_side_or_of_an_unknown_type_is_refused():
    with pytest.raises(MessageError, match="expected one of Push, Digests, Grant, Stop"):
        loads(dumps(Ready(0)), TO_WORKER)
    buf = io.BytesIO()
    torch.save({"__type__": "Shutdown", "now": True}, buf)
    with pytest.raises(MessageError, match="unknown message type 'Shutdown'"):
        loads(buf.getvalue(), TO_WORKER)
    with pytest.raises(MessageError, match="not a message type"):
        dumps(("push", 1))
    with pytest.raises(MessageError, match="cannot encode a object"):
        dumps(EvalResult(0, 1, {"x": object()}))


class Evil:
    """Unpickling it would create `path` (what any code could do)."""

    def __init__(self, path):
        self.path = path

    def __reduce__(self):
        return (open, (str(self.path), "w"))


def test_a_crafted_queue_message_is_refused_and_never_run(tmp_path):
    marker = tmp_path / "marker"
    buf = io.BytesIO()
    torch.save({"__type__": "Grant", "count": Evil(marker)}, buf)
    with pytest.raises(MessageError, match="tensors-only"):
        loads(buf.getvalue(), TO_WORKER)
    assert not marker.exists()


def test_pending_batches_round_trip_through_a_safetensors_file(tmp_path):
    # Batch 2 with rows that mix versions 1 and 2 (in-flight updates; -1 at padding).
    mixed = scored(1)
    versions = torch.tensor([[1, 2, -1], [1, 1, -1], [2, 2, -1], [1, 2, -1]])
    mixed = dataclasses.replace(mixed, rollout=dataclasses.replace(mixed.rollout, token_versions=versions))
    items = [Pending(2, mixed, 16, {"timing/generate_s": 0.5}), Pending(3, scored(2), 24, {})]
    path = tmp_path / "rollouts.safetensors"
    save_pending(path, items)
    assert path.read_bytes()[:8] != b"PK\x03\x04"  # not a torch (zip of pickles) file
    assert same(load_pending(path), items)
    save_pending(path, [])
    assert load_pending(path) == []
    assert [p.name for p in tmp_path.iterdir()] == [path.name]  # the temporary file was renamed


def test_a_crafted_pending_file_is_refused_naming_it_and_never_run(tmp_path):
    marker, path = tmp_path / "marker", tmp_path / "rollouts.safetensors"
    torch.save([Evil(marker)], path)
    with pytest.raises(MessageError, match="rollouts.safetensors is not a pending-batches file"):
        load_pending(path)
    assert not marker.exists()


def test_a_batch_with_images_round_trips():
    """Images travel as pixel tensors, their processor tensors and digest; pictures come back pixel for pixel."""
    from PIL import Image

    from rlkit.batch import Images

    red = Image.new("RGB", (5, 3), (255, 0, 0))
    noise = Image.frombytes("RGB", (2, 4), bytes(range(24)))
    pics = Images(
        (red, noise), {"pixel_values": torch.randn(6, 4), "image_grid_thw": torch.tensor([[1, 2, 2]])}, "d"
    )
    batch = scored()
    batch = dataclasses.replace(
        batch, rollout=dataclasses.replace(batch.rollout, images=(pics, pics, None, None))
    )
    back = loads(dumps(BatchShare(worker=0, index=1, batch=batch, position=0, seconds={})), TO_LEARNER).batch
    got = back.rollout.images
    assert got[2:] == (None, None) and got[0].digest == "d"
    assert same(got[0].tensors, pics.tensors)
    assert [p.size for p in got[1].pictures] == [(5, 3), (2, 4)]
    assert [p.tobytes() for p in got[1].pictures] == [red.tobytes(), noise.tobytes()]
