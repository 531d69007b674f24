"""What crosses between the learner and the rollout workers, and how it is written: the typed messages, the
pending batch of a checkpoint, and their tensors-only encoding.

Messages are small frozen dataclasses, never positional tuples. Learner -> worker (one control queue per
worker): `Push`, `Digests`, `Grant`, `Stop`. Worker -> learner (one results queue): `Ready`, `BatchShare`,
`EvalResult`; and a failing worker's `WorkerError` on its own one-way pipe, written synchronously before
it exits and bounded (`worker_error`) to fit an empty pipe's buffer, so it arrives whether or not the
learner is reading and whatever is still queued on the results queue.

Nothing is unpickled. `encode` turns a message into a tree of tensors, bools, ints, floats, strs, None,
lists and str-keyed dicts: a dataclass becomes `{"__type__": its name, field: value, ...}` and a tuple
`{"__tuple__": [...]}`, a prompt's picture (PIL) `{"__picture__": [H, W, 3] uint8 pixels}`. On a queue the tree travels as `torch.save` bytes read back with
`torch.load(weights_only=True)` (so no shared-memory handle outlives its sender either); the pending
batches of a checkpoint are a safetensors file holding the tree's tensors, with the rest of the tree as
JSON in its header. `decode` rebuilds only the dataclasses listed in `TYPES` and refuses any other tag, and
each reader refuses a message that is not one it expects: a crafted message or file cannot run code.
"""

from __future__ import annotations

import dataclasses
import io
import json
import os
from pathlib import Path

import numpy as np
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from rlkit.batch import Images, RolloutBatch, ScoredBatch
from rlkit.weights import Manifest


class MessageError(ValueError):
    """A message or a pending-batches file that is not one rlkit wrote (it is refused, never executed)."""


# -- learner -> worker -------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Push:
    """Version `version` follows on the bridge (in `manifest` order); then generate `grant` more batches."""

    version: int
    evaluate: bool
    """Evaluate the new weights (worker 0 reports an `EvalResult`)."""
    grant: int
    manifest: Manifest


@dataclasses.dataclass(frozen=True)
class Grant:
    """Generate `count` more batches with the weights held now."""

    count: int


@dataclasses.dataclass(frozen=True)
class Digests:
    """The digest (rlkit.digests) of every tensor of push `version` as the learner sent it: check the engine against them
    (`rollout.verify_push`; sent right after the push's broadcast)."""

    version: int
    digests: dict[str, str]
    probe: torch.Tensor | None = None
    """The learner's log-probs on the probe's fixed tokens (rlkit.verify.probe_tokens), or None."""
    probe_dtype: str = "float32"
    """The dtype the learner computed `probe` in (its bound: rlkit.verify.probe_bound)."""
    probe_tokens: torch.Tensor | None = None
    """The fixed tokens `probe` was computed on (rlkit.verify.probe_tokens over the learner's probe_vocab)."""
    probe_images: tuple | None = None
    """Each probe row's rlkit.batch.Images, for a vision-language policy (rlkit.verify.vl_probe_prompt), or None."""


@dataclasses.dataclass(frozen=True)
class Stop:
    """Exit (after the learner's last checkpoint)."""


# -- worker -> learner -------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Ready:
    """Worker `worker` has built its engine and joins the bridge next."""

    worker: int


@dataclasses.dataclass(frozen=True)
class BatchShare:
    """Worker `worker`'s share of granted batch `index` (the learner merges the shares in worker order)."""

    worker: int
    index: int
    batch: ScoredBatch
    position: int
    """The data order's position after the batch's prompts were drawn."""
    seconds: dict[str, float]
    """The worker's phase timers (timing/generate_s, ...)."""


@dataclasses.dataclass(frozen=True)
class EvalResult:
    worker: int
    version: int
    metrics: dict[str, float]


@dataclasses.dataclass(frozen=True)
class WorkerError:
    """Worker `worker` failed; `traceback` is its formatted traceback (sent before it exits)."""

    worker: int
    traceback: str


# A pipe holds 64 KiB before a writer blocks: a traceback of up to this many characters (4 bytes each at
# most in UTF-8) and its encoding fit, so a failing worker never waits for the learner to read.
MAX_TRACEBACK_CHARS = 12_000


def worker_error(worker: int, text: str) -> WorkerError:
    """The `WorkerError` of `text`, its middle cut when it is longer than MAX_TRACEBACK_CHARS (the start
    of the traceback and its end, with the exception, are kept)."""
    if len(text) > MAX_TRACEBACK_CHARS:
        head, tail = MAX_TRACEBACK_CHARS // 5, MAX_TRACEBACK_CHARS * 4 // 5
        cut = len(text) - head - tail
        text = f"{text[:head]}\n... [{cut} characters cut] ...\n{text[-tail:]}"
    return WorkerError(worker, text)


TO_WORKER = (Push, Digests, Grant, Stop)
TO_LEARNER = (Ready, BatchShare, EvalResult)
MESSAGES = (*TO_WORKER, *TO_LEARNER, WorkerError)


# -- the checkpoint's pending batches ----------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Pending:
    """A scored global batch the learner has received and not trained yet."""

    index: int
    """Its place in the sequence of granted batches (its sampling seeds derive from it)."""
    batch: ScoredBatch
    position: int
    """The data order's position after its prompts were drawn."""
    seconds: dict[str, float]
    """The worker's phase timers (timing/generate_s, timing/reward_s, ...)."""


TYPES = {cls.__name__: cls for cls in (*MESSAGES, Pending, ScoredBatch, RolloutBatch, Images)}


# -- the encoding ------------------------------------------------------------------------------------


def encode(obj):
    """`obj` as a tree of tensors and plain values (dataclasses of `TYPES` and tuples tagged)."""
    if isinstance(obj, torch.Tensor):
        return obj.detach().cpu()
    if obj is None or isinstance(obj, (bool, str)):
        return obj
    if isinstance(obj, int):
        return int(obj)
    if isinstance(obj, float):
        return float(obj)  # numpy's float64 too, as a plain float
    if dataclasses.is_dataclass(obj) and type(obj).__name__ in TYPES:
        fields = {f.name: encode(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
        return {"__type__": type(obj).__name__, **fields}
    if isinstance(obj, tuple):
        return {"__tuple__": [encode(v) for v in obj]}
    if _is_picture(obj):  # a prompt's picture (rlkit.batch.Images.pictures): its RGB pixels, [H, W, 3] uint8
        return {"__picture__": torch.from_numpy(np.array(obj.convert("RGB"), dtype=np.uint8))}
    if isinstance(obj, list):
        return [encode(v) for v in obj]
    if isinstance(obj, dict):
        for key in obj:
            if not isinstance(key, str) or key.startswith("__"):
                raise MessageError(f"cannot encode dict key {key!r}: keys are strs not starting with '__'")
        return {key: encode(v) for key, v in obj.items()}
    raise MessageError(f"cannot encode a {type(obj).__name__} (tensors and plain values only)")


def decode(tree):
    """The object `encode` made `tree` of; a type tag outside `TYPES` raises MessageError."""
    if isinstance(tree, list):
        return [decode(v) for v in tree]
    if not isinstance(tree, dict):
        return tree
    if "__tuple__" in tree:
        return tuple(decode(v) for v in tree["__tuple__"])
    if "__picture__" in tree:
        return _picture(tree["__picture__"])
    if "__type__" not in tree:
        return {key: decode(v) for key, v in tree.items()}
    name = tree["__type__"]
    cls = TYPES.get(name) if isinstance(name, str) else None
    if cls is None:
        raise MessageError(f"unknown message type {name!r}; known: {', '.join(TYPES)}")
    fields = {key: decode(v) for key, v in tree.items() if key != "__type__"}
    try:
        return cls(**fields)
    except (TypeError, ValueError) as e:
        raise MessageError(f"a {name} with fields {sorted(fields)} is malformed: {e}") from None


def _is_picture(obj) -> bool:
    return type(obj).__module__.startswith("PIL.") and hasattr(obj, "convert") and hasattr(obj, "size")


def _picture(pixels):
    """The PIL picture of `[H, W, 3]` uint8 pixels; anything else raises MessageError."""
    from PIL import Image

    if (
        not isinstance(pixels, torch.Tensor)
        or pixels.dtype != torch.uint8
        or pixels.dim() != 3
        or pixels.shape[2] != 3
    ):
        raise MessageError(f"a picture must be [H, W, 3] uint8 pixels, got {type(pixels).__name__}")
    return Image.fromarray(pixels.numpy(), "RGB")


def dumps(msg) -> bytes:
    """The bytes of message `msg` for a queue."""
    if not isinstance(msg, MESSAGES):
        raise MessageError(f"{type(msg).__name__} is not a message type")
    buf = io.BytesIO()
    torch.save(encode(msg), buf)
    return buf.getvalue()


def loads(data: bytes, accept: tuple[type, ...]):
    """The message in `data`, which must be one of the types `accept` (anything else raises MessageError)."""
    try:
        tree = torch.load(io.BytesIO(data), weights_only=True)
    except Exception as e:
        raise MessageError(f"refused a message that is not rlkit's tensors-only encoding: {e}") from None
    msg = decode(tree)
    if not isinstance(msg, accept):
        names = ", ".join(cls.__name__ for cls in accept)
        raise MessageError(f"refused a message of type {type(msg).__name__}: expected one of {names}")
    return msg


# -- the pending-batches file -------------------------------------------------------------------------

_META_KEY = "rlkit.pending"


def _split_tensors(tree, tensors: dict):
    """`tree` with each tensor replaced by {"__tensor__": key} and stored in `tensors` under that key."""
    if isinstance(tree, torch.Tensor):
        key = str(len(tensors))
        tensors[key] = tree.contiguous().clone()  # safetensors refuses tensors that share storage
        return {"__tensor__": key}
    if isinstance(tree, list):
        return [_split_tensors(v, tensors) for v in tree]
    if isinstance(tree, dict):
        return {k: _split_tensors(v, tensors) for k, v in tree.items()}
    return tree


def _join_tensors(tree, tensors: dict):
    if isinstance(tree, list):
        return [_join_tensors(v, tensors) for v in tree]
    if isinstance(tree, dict):
        if set(tree) == {"__tensor__"}:
            return tensors[tree["__tensor__"]]
        return {k: _join_tensors(v, tensors) for k, v in tree.items()}
    return tree


def save_pending(path: str | Path, items: list[Pending]) -> None:
    """Write `items` to `path` (safetensors; written beside it and renamed into place)."""
    path = Path(path)
    tensors: dict = {}
    skeleton = _split_tensors(encode(list(items)), tensors)
    tmp = path.with_name(f".{path.name}.tmp")
    save_file(tensors, tmp, metadata={_META_KEY: json.dumps(skeleton)})
    os.replace(tmp, path)


def load_pending(path: str | Path) -> list[Pending]:
    """The batches `save_pending` wrote to `path`; any other file raises MessageError naming it."""
    try:
        with safe_open(str(path), framework="pt") as f:
            skeleton = json.loads((f.metadata() or {})[_META_KEY])
            tensors = {key: f.get_tensor(key) for key in f.keys()}
        items = decode(_join_tensors(skeleton, tensors))
    except Exception as e:
        raise MessageError(
            f"{path} is not a pending-batches file written by rlkit (safetensors with rlkit's JSON header), "
            f"so the resume is refused (it is never unpickled): {type(e).__name__}: {e}"
        ) from None
    if not isinstance(items, list) or not all(isinstance(p, Pending) for p in items):
        raise MessageError(f"{path} does not hold a list of pending batches")
    return items
