"""What the learner exports and how it travels to the rollout engines: names, manifest, push / send / receive.

The learner and the rollout side never import each other; they meet here. The learner describes its
weights as an `Export`: a manifest ({HF name: shape}, read from parameter metadata) and a stream of
(HF name, full tensor) pairs, one parameter at a time (FSDP2 shards gathered per parameter). The engine
copies each into its own model as it arrives, so the push never holds a second full copy of the model on
one device. Which parameters are exported and under which names is decided once, by `exported` and
`clean_param_name`, for both the manifest and the stream.

A push is right or loud. Before the first tensor is copied, the engine checks the learner's whole
manifest (every name and shape, read from parameter metadata, so nothing is gathered for it) against
the names and shapes it computes with; a mismatch raises and leaves the engine untouched. While the
tensors stream, each one is checked against the manifest again. A push that fails after it started
copying leaves the engine refusing to generate (`PushGuard.check`) until a complete push succeeds:
a half-updated model is neither the old policy nor the new one.

Across processes (trainer.mode=async), `send_weights` broadcasts the same stream from learner rank 0 and
`receive_weights` hands it, tensor by tensor, to the worker engine's same checked `load_weights`.

Whether the engine then holds what was pushed (digests, the log-prob probe) is checked by rlkit.verify.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass

import torch
from torch import Tensor

from rlkit.collectives import broadcast, wait_on_host
from rlkit.digests import tensor_digest, to_host

Manifest = dict[str, tuple[int, ...]]

# Module names that wrappers (FSDP1, DDP, torch.compile, activation checkpointing) insert into
# parameter names; the rollout engines expect the plain transformers names.
WRAPPER_PARTS = ("_fsdp_wrapped_module", "_orig_mod", "_checkpoint_wrapped_module")


@dataclass(frozen=True)
class Export:
    """A policy's weights as the rollout side receives them.

    `tensors()` starts the stream; every learner rank must consume it in lock-step (each FSDP2 gather is
    a collective), and its names and shapes are exactly `manifest`'s, in order.
    """

    manifest: Manifest
    tensors: Callable[[], Iterator[tuple[str, Tensor]]]
    probe: Callable[[Tensor], Tensor] | None = None
    """The learner's log-probs of `tokens[:, 1:]` given their prefixes (temperature 1, no truncation), [N, L-1]
    float32 on the CPU, for the push's log-prob probe (`probe_gap`); every learner rank must call it."""
    probe_dtype: torch.dtype = torch.float32
    """The dtype the learner computes `probe` in (its bound: `probe_bound`)."""
    probe_vocab: int = 1000
    """The ids the probe's tokens are drawn from, `[0, probe_vocab)` (`probe_tokens`; the learner's `probe_vocab`
    of its tokenizer and embedding)."""
    probe_prompt: tuple[Tensor, tuple] | None = None
    """A vision-language policy's probe input instead of the fixed tokens: [rows, L] ids, each row a picture's
    placeholders expanded by the model's processor then drawn ids, and each row's rlkit.batch.Images
    (`vl_probe_prompt`); `probe` then takes `(tokens, images)`, so the push is probed through the vision tower."""


def clean_param_name(name: str) -> str:
    """Strip wrapper components (FSDP1, torch.compile, activation checkpointing, a leading DDP `module.`)."""
    parts = [p for p in name.split(".") if p not in WRAPPER_PARTS]
    while parts and parts[0] == "module":
        parts = parts[1:]
    return ".".join(parts)


def exported(module: torch.nn.Module) -> list[tuple[str, Tensor]]:
    """(clean HF name, tensor) of what a module exports: its parameters, then its persistent buffers; a
    tied parameter once, under its first name. The tensors may be DTensor shards (not gathered here)."""
    persistent = {
        f"{mod_name}.{b}" if mod_name else b
        for mod_name, mod in module.named_modules()
        for b in mod._buffers
        if b not in mod._non_persistent_buffers_set
    }
    named = list(module.named_parameters()) + [(n, b) for n, b in module.named_buffers() if n in persistent]
    seen: set[int] = set()
    out = []
    for name, tensor in named:
        if id(tensor) in seen:
            continue
        seen.add(id(tensor))
        out.append((clean_param_name(name), tensor))
    return out


def reshard(module: torch.nn.Module) -> None:
    """Put every FSDP2 module inside `module` back in its sharded state (a no-op without FSDP2).

    After a forward without gradients FSDP2 leaves the root's parameters unsharded (it expects a backward to
    follow), and an unsharded parameter is FSDP2's own buffer, which its next reshard frees by resizing the
    storage to 0. Handed out, such a tensor would be freed under its holder (vLLM's reload buffers what it
    loads), and one `.numpy()` of it (safetensors, a sha256 of its bytes) marks the storage non-resizable, so that FSDP2's next reshard
    fails: "Trying to resize storage that is not resizable"."""
    from torch.distributed.fsdp import FSDPModule

    for m in module.modules():
        if isinstance(m, FSDPModule):
            m.reshard()


def iter_full_parameters(module: torch.nn.Module) -> Iterator[tuple[str, Tensor]]:
    """(clean HF name, full tensor) of `exported(module)`, one at a time.

    FSDP2 parameters are DTensor shards (resharded first: `reshard`): `full_tensor()` all-gathers just that
    one parameter into a tensor of its own, so peak extra memory is one full parameter, never the whole
    model. Every rank must consume the iterator in lock-step (each gather is a collective).
    """
    from torch.distributed.tensor import DTensor

    reshard(module)
    for name, tensor in exported(module):
        full = tensor.full_tensor() if isinstance(tensor, DTensor) else tensor
        yield name, full.detach()


class WeightSyncError(RuntimeError):
    """The rollout engine's weights differ from the learner's (the weight push did not happen, or not whole)."""


class WeightManifestError(ValueError):
    """The learner's weights and the engine's do not have the same names and shapes."""


def module_manifest(module: torch.nn.Module) -> Manifest:
    """{clean HF name: shape} of what `iter_full_parameters(module)` yields, without gathering (a DTensor's
    `.shape` is its global shape)."""
    return {name: tuple(tensor.shape) for name, tensor in exported(module)}


def tied_aliases(module: torch.nn.Module) -> dict[str, list[str]]:
    """{manifest name: the other names of that same parameter} (e.g. a tied `lm_head.weight`)."""
    first: dict[int, str] = {}
    aliases: dict[str, list[str]] = {}
    for name, p in module.named_parameters(remove_duplicate=False):
        name = clean_param_name(name)
        if id(p) in first:
            aliases.setdefault(first[id(p)], []).append(name)
        else:
            first[id(p)] = name
    return aliases


def check_manifest(given: Manifest, expected: Manifest, *, engine: str) -> None:
    """Raise `WeightManifestError` naming every missing, unexpected or misshaped weight."""
    missing = [n for n in expected if n not in given]
    unknown = [n for n in given if n not in expected]
    shapes = [
        f"{n}: pushed {given[n]}, engine has {expected[n]}"
        for n in given
        if n in expected and given[n] != expected[n]
    ]
    if missing or unknown or shapes:
        parts = []
        if missing:
            parts.append(f"missing {missing[:5]}{' ...' if len(missing) > 5 else ''} ({len(missing)})")
        if unknown:
            parts.append(
                f"unknown to the engine {unknown[:5]}{' ...' if len(unknown) > 5 else ''} ({len(unknown)})"
            )
        if shapes:
            parts.append("shape mismatch: " + "; ".join(shapes[:5]))
        raise WeightManifestError(
            f"weight push refused before copying anything ({engine} engine): " + ", ".join(parts)
        )


class PushGuard:
    """Tracks whether the engine's weights are whole; shared by both engines.

    `stream(named, manifest)` yields the pairs, checking each against the manifest (unknown name:
    `KeyError`; wrong shape: `WeightManifestError`; a name twice or one missing at the end:
    `WeightManifestError`). The engine calls `started()` before its first copy and `finished()` after
    its last; an exception in between leaves the guard broken, and `check()` then raises.
    """

    def __init__(self, engine: str):
        self.engine = engine
        self.broken: str | None = None
        self._in_progress = False

    def check(self) -> None:
        if self.broken is not None:
            raise RuntimeError(
                f"the {self.engine} engine refuses to generate: its last weight push failed midway "
                f"({self.broken}), so its weights are partly old and partly new. Push a complete set "
                "of weights (rlkit.weights.push_weights) first."
            )

    def stream(self, named: Iterable[tuple[str, Tensor]], manifest: Manifest) -> Iterator[tuple[str, Tensor]]:
        seen: set[str] = set()
        for name, tensor in named:
            if name not in manifest:
                raise KeyError(f"load_weights: unknown parameter {name!r} (not in the push's manifest)")
            if tuple(tensor.shape) != manifest[name]:
                raise WeightManifestError(
                    f"load_weights: {name!r} has shape {tuple(tensor.shape)}, the manifest says {manifest[name]}"
                )
            if name in seen:
                raise WeightManifestError(f"load_weights: {name!r} was pushed twice")
            seen.add(name)
            yield name, tensor
        if not seen:
            raise RuntimeError("load_weights received no tensors: the weight push updated nothing")
        missing = [n for n in manifest if n not in seen]
        if missing:
            raise WeightManifestError(
                f"load_weights: the push ended before {len(missing)} weights of its manifest arrived: {missing[:5]}"
            )

    def run(self, copy, named: Iterable[tuple[str, Tensor]], manifest: Manifest) -> int:
        """`copy(checked_stream)` with the bookkeeping: broken on any exception once copying started."""
        count = 0

        def counted():
            nonlocal count
            for pair in self.stream(named, manifest):
                count += 1
                yield pair

        try:
            copy(counted())
        except BaseException as e:
            if count > 0 or self.broken is not None:
                self.broken = f"{type(e).__name__}: {e}"
            raise
        self.broken = None
        return count


def _counted(
    named: Iterable[tuple[str, Tensor]], stats: dict, dtype: torch.dtype | None, digests: dict | None = None
) -> Iterator:
    """The stream with its bookkeeping: counts, bytes, and the seconds spent producing each tensor (the
    export: an FSDP2 all-gather, a LoRA merge) and casting it, so the engine's own part is the rest. With a
    `digests` dict, each tensor's digest as streamed (cast), on its device (rlkit.digests: no host copy here)."""
    stats.setdefault("export_seconds", 0.0)
    stats.setdefault("cast_seconds", 0.0)
    it = iter(named)
    while True:
        t0 = time.perf_counter()
        try:
            name, tensor = next(it)
        except StopIteration:
            stats["export_seconds"] += time.perf_counter() - t0
            return
        t1 = time.perf_counter()
        if dtype is not None:
            tensor = tensor.to(dtype)
        stats["export_seconds"] += t1 - t0
        stats["cast_seconds"] += time.perf_counter() - t1
        stats["num_tensors"] += 1
        stats["num_params"] += tensor.numel()
        stats["bytes"] += tensor.numel() * tensor.element_size()
        if digests is not None:
            digests[name] = tensor_digest(tensor)
        yield name, tensor


def push_weights(
    export: Export, engine, *, dtype: torch.dtype | None = None, digests: dict | None = None
) -> dict[str, float]:
    """Stream the learner's `export` into `engine.load_weights`; every rank must call it.

    The engine first checks the learner's manifest (names and shapes from parameter metadata), so a
    push that cannot fit fails before anything is copied or gathered. `dtype` casts each tensor
    before it is handed over (e.g. bf16 for a bf16 engine, halving the bytes moved); None keeps the
    learner's dtype (fp32 master weights) and lets the engine cast.
    Returns stats: `seconds`, `num_tensors`, `num_params`, `bytes`, `gb_per_s`, and the parts of `seconds`:
    `export_seconds` (producing the tensors), `cast_seconds`, `load_seconds` (the engine's own: for vLLM the
    copy into its layers, their reprocessing into kernel format and the prefix-cache reset).
    With a `digests` dict, fills it with {name: digest} of every tensor as it was streamed (`check_engine`
    compares the engine with them): the export is gathered once per push, and digested where it is.
    """
    stats = {"num_tensors": 0, "num_params": 0, "bytes": 0}
    start = time.perf_counter()
    streamed: dict | None = None if digests is None else {}
    engine.load_weights(_counted(export.tensors(), stats, dtype, streamed), manifest=export.manifest)
    if streamed is not None:
        digests.update(to_host(streamed))
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    if stats["num_tensors"] == 0:
        raise RuntimeError("push_weights: the learner exported no tensors")
    done = _finished(stats, start)
    done["load_seconds"] = max(0.0, done["seconds"] - stats["export_seconds"] - stats["cast_seconds"])
    return done


def _finished(stats: dict, start: float) -> dict[str, float]:
    seconds = time.perf_counter() - start
    return {**stats, "seconds": seconds, "gb_per_s": stats["bytes"] / 1e9 / max(seconds, 1e-9)}


# -- across processes (trainer.mode=async: rlkit/rollout/remote/) ------------------------------------


def send_weights(
    pg, export: Export, dtype: torch.dtype, *, is_main: bool, device, digests: dict | None = None,
    timeout_s: float = 600.0, alive: Callable[[], None] | None = None,
) -> dict[str, float]:  # fmt: skip
    """Broadcast the learner's `export` from learner rank 0 (root of `pg`), cast to `dtype`, in the order of
    its manifest; every learner rank must call it (FSDP2 gathers each parameter on all ranks). With a
    `digests` dict, rank 0 fills it with each sent tensor's digest (what the workers check their engines
    against: `check_engine`), computed on the device and copied to the host once, after the last broadcast. Rank 0 returns once the last broadcast has finished on the host (under NCCL
    the broadcasts are only queued on the GPU; `alive()` is called while waiting and raises to name a
    receiver that died; rlkit.collectives.wait_on_host)."""
    names = list(export.manifest)
    stats = {"num_tensors": 0, "num_params": 0, "bytes": 0}
    start = time.perf_counter()
    named = export.tensors()
    if not is_main:
        for _ in named:  # take part in the gathers
            pass
        return _finished(stats, start)
    work = None
    streamed: dict | None = None if digests is None else {}
    for i, (name, tensor) in enumerate(_counted(named, stats, dtype, streamed)):
        if i >= len(names) or name != names[i]:
            raise RuntimeError(
                f"weight push: the learner yielded {name!r} where the manifest has "
                f"{names[i] if i < len(names) else 'nothing more'!r}; the workers receive in manifest order"
            )
        _, work = broadcast(pg, tensor.detach(), device)
    if work is not None:
        wait_on_host(work, timeout_s, alive)
    if streamed is not None:
        digests.update(to_host(streamed))
    done = _finished(stats, start)
    # The rest of the push: digests and the broadcast to the workers (their engines load on their own).
    done["transfer_seconds"] = max(0.0, done["seconds"] - stats["export_seconds"] - stats["cast_seconds"])
    return done


def receive_weights(pg, engine, manifest: Manifest, dtype: torch.dtype, device) -> None:
    """Receive one `send_weights` (every tensor of `manifest`, in order) into `engine.load_weights`.

    If the engine refuses midway, the rest is still received (the sender would otherwise wait on the
    broadcast until its timeout) and the engine's error is raised after.
    """

    def stream():
        for name, shape in manifest.items():
            yield name, broadcast(pg, torch.empty(shape, dtype=dtype, device=device), device)[0]

    tensors = stream()
    try:
        engine.load_weights(tensors, manifest=manifest)
    except BaseException:
        for _ in tensors:  # drain
            pass
        raise
