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
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass

import torch
from torch import Tensor

from rlkit.batch import Images
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


# -- verifying a push: what the engine holds, tensor by tensor ---------------------------------------------


def engine_sources(loads: dict[str, list[str]], origins: dict[str, list[str]]) -> dict[str, list[str]]:
    """{engine tensor: the learner tensors it is built from}, from what a push recorded: `loads` ({checkpoint
    tensor: the engine tensors its loader wrote}, vLLM's own loaders) and `origins` ({checkpoint tensor: the
    learner tensors it is made from})."""
    out: dict[str, set[str]] = {}
    for ck, targets in loads.items():
        for e in targets:
            out.setdefault(e, set()).update(origins.get(ck, ()))
    return {e: sorted(src) for e, src in out.items() if src}


def learner_digests(export: Export, dtype: torch.dtype) -> dict[str, str]:
    """{name: digest} of the learner's tensors cast to `dtype`, from a fresh export (every rank must call it:
    the gathers are collectives). A push digests what it streams instead (`push_weights(digests=)`); this is
    for the engine as loaded, before any push."""
    return to_host({n: tensor_digest(t.to(dtype)) for n, t in export.tensors()})


def verify_push(export: Export, engine, previous: dict | None = None) -> dict:
    """`check_engine` against a fresh export of the learner's tensors (the engine as loaded at start-up, and
    tests); every rank calls it. Returns the digests to pass as `previous` next time."""
    return check_engine(learner_digests(export, engine.weight_dtype), engine, previous)


def _sync_error(engine, what: str, names: list[str]) -> WeightSyncError:
    return WeightSyncError(
        f"after the weight push the {engine.name} engine's {names[:3]}{' ...' if len(names) > 3 else ''} "
        f"({len(names)} tensors) {what}: the push did not reach the engine whole, or the engine mangled it. "
        f"Train this model with rollout.engine=hf if it persists"
    )


def check_engine(learner: dict[str, str], engine, previous: dict | None = None) -> dict:
    """Check by content that the engine holds what the learner pushed: `learner` is {name: digest} of the
    learner's tensors as pushed (cast to the engine's dtype; rlkit.digests). Raises `WeightSyncError` naming the
    tensors; returns the digests to pass as `previous` to the next check.

    An engine in the checkpoint's layout (HF: `engine.expected_digests()` is None) must hold every pushed tensor
    exactly. One that stacks and repacks them (vLLM) is checked in two steps, both by content:
    - what its last push received (`engine.received_digests()`, digested as its `load_weights` took them) is
      what the learner pushed, tensor by tensor (a push that arrived nowhere, or not whole, or other bytes);
    - every engine tensor a push determines holds, at every position its loaders wrote, what they wrote there
      (`engine.expected_digests()`: the pushed tensors' digests placed at the positions vLLM's own loaders put
      them, against `engine.weight_digests()`: the tensors as held, a repacked linear's read back from its
      kernel), so a layer left stale after the push, or two rows swapped, fails whatever the learning rate.
    Before any push (`received_digests()` None: the engine as loaded) nothing is compared unless a push is being
    verified (`previous` given). Engine tensors whose
    processing after loading changes their values (vLLM's CPU expert prepack) or that no loader wrote are left to
    a check by change (`engine.digest_sources()`: every one built from a learner tensor that changed since
    `previous` must have changed) and to the log-prob probe.
    """
    held = engine.weight_digests()
    expected = engine.expected_digests()
    if expected is None:
        wrong = [n for n, d in learner.items() if held.get(n) != d]
        if wrong or not learner:
            raise WeightSyncError(
                f"after the weight push the {engine.name} engine does not hold the learner's {wrong[:3]} "
                f"({len(wrong)} of {len(learner)} tensors differ): the push did not reach the engine whole"
            )
        return {"learner": learner, "engine": held}
    received = engine.received_digests()
    if received is None and previous is not None:  # a push is being verified, and the engine received none
        received = {}
    if received is not None:
        late = [n for n, d in learner.items() if received.get(n) != d]
        if late or not learner:
            raise _sync_error(engine, "were not received as the learner pushed them", late)
        wrong = [e for e, d in expected.items() if held.get(e) != d]
        if wrong:
            raise _sync_error(engine, "do not hold what the push loaded into them", wrong)
    if previous is not None:
        _check_by_change(learner, engine, previous, {e: d for e, d in held.items() if e not in expected})
    return {"learner": learner, "engine": held}


def _check_by_change(learner: dict[str, str], engine, previous: dict, held: dict[str, str]) -> None:
    """The engine tensors `held` that the content check cannot read: unchanged learner weights must leave every
    one as it was; one built from a learner tensor that changed must have changed."""
    sources = engine.digest_sources()
    changed = {n for n, d in learner.items() if previous["learner"].get(n) != d}
    before = previous["engine"]
    if not changed:
        moved = [e for e, d in held.items() if e in before and before[e] != d]
        if moved:
            raise _sync_error(engine, "changed although the learner's weights did not", moved)
    stale = [e for e, src in sources.items() if e in held and changed & set(src) and before.get(e) == held[e]]
    if stale:
        raise _sync_error(
            engine, "did not change although the learner's weights they are built from did", stale
        )


# -- the log-prob probe: the engine's forward against the learner's on fixed tokens --------------------------

PROBE_BOUND = {
    (torch.float32, "cpu"): 1e-4,
    (torch.float32, "cuda"): 0.03,
    (torch.bfloat16, "cpu"): 0.25,
    (torch.bfloat16, "cuda"): 0.25,
    (torch.float16, "cpu"): 0.05,
    (torch.float16, "cuda"): 0.05,
}
"""The mean |engine - learner| log-prob on the probe's tokens above which a push (or the engine as loaded) is
refused, by (dtype, the engine's platform), for the lower precision of the two sides:
- fp32 on the CPU: the families rlkit tests agree to ~5e-7 (tests/rollout/test_families.py,
  docs/supported-models.md), while an engine missing its MoE expert prepack after a push differed by 2e-2.
- fp32 on CUDA (not measured yet: scripts/gpu_check.py's probe gap is the measurement to take): vLLM's Triton
  attention computes its fp32 dot products in TF32 (10 mantissa bits, 3 more than bf16), so the gap is expected
  at about bf16's measured 0.064 / 8, ~8e-3 (issue 61 item 3 estimated 1e-3); 0.03 keeps bf16's margin (~4x)
  over that. A stale or mangled tensor at a small learning rate is caught by the content digests, not the probe.
- bf16 (any platform): on SmolLM2-135M the probe's random tokens (log-probs around -11) read 0.045 between an fp32
  forward and a bf16-autocast one and 0.064 with bf16 weights (max 0.27), so an engine and a learner both off by
  that much stay under 0.25; a drift as small as the MoE one is then left to the digests.
- fp16 (3 more mantissa bits than bf16, not measured): 0.05.
A platform other than the CPU (vLLM's ROCm reports "cuda"; XPU, TPU) takes the CUDA entry: accelerator kernels may
compute with reduced-precision dots; a dtype not listed takes bf16's."""


def probe_bound(*dtypes: torch.dtype, platform: str = "cpu") -> float:
    """The probe's bound for log-probs computed in `dtypes` (the learner's and the engine's) by an engine on
    `platform` (vLLM's device type: "cpu", "cuda", ...): the loosest (PROBE_BOUND)."""
    key = "cpu" if platform == "cpu" else "cuda"
    return max(PROBE_BOUND.get((d, key), PROBE_BOUND[(torch.bfloat16, key)]) for d in dtypes)


def probe_vocab(tokenizer_size: int, embedding_rows: int) -> int:
    """The ids the probe may use: those both the tokenizer (vLLM refuses a prompt id beyond it) and the model's
    embedding (which may have padding rows beyond the tokenizer, or fewer rows) know."""
    return max(1, min(int(tokenizer_size), int(embedding_rows)))


def probe_tokens(vocab_size: int = 1000, *, rows: int = 2, length: int = 32, seed: int = 0) -> Tensor:
    """[rows, length] token ids spread over the whole vocabulary `[0, vocab_size)`: one drawn in each of
    rows x length equal slices of it, in a shuffled order, the same on every call. The probe's fixed input: a
    stale or swapped row of the embedding or the output head is read wherever it sits, near the top of the
    vocabulary too (ids below 1000 only, before: issue 56). The learner sends them with its log-probs (async) or
    hands them to the engine's check itself (`Export.probe_vocab`)."""
    g = torch.Generator().manual_seed(seed)
    n = rows * length
    lo = torch.tensor([i * vocab_size // n for i in range(n)])
    hi = torch.tensor([(i + 1) * vocab_size // n for i in range(n)])
    ids = lo + (torch.rand(n, generator=g) * (hi - lo).clamp(min=1)).long()
    return ids.clamp(max=vocab_size - 1)[torch.randperm(n, generator=g)].view(rows, length)


def probe_input(export: Export) -> tuple[Tensor, tuple | None]:
    """(tokens, images) the probe runs on: the export's `probe_prompt` (a prompt with a picture per row), else the
    fixed tokens over its `probe_vocab` and no images."""
    if export.probe_prompt is not None:
        return export.probe_prompt
    return probe_tokens(export.probe_vocab), None


def learner_probe(export: Export, tokens: Tensor, images: tuple | None) -> Tensor:
    """The learner's probe log-probs of `tokens` (with each row's `images` where the probe has them)."""
    return export.probe(tokens) if images is None else export.probe(tokens, images)


# The text that marks one picture in a prompt, by processor class (else its `image_token`): the processor expands
# it into the picture's placeholder tokens.
_PICTURE_MARKS = {
    "Qwen2VLProcessor": "<|vision_start|><|image_pad|><|vision_end|>",
    "Qwen2_5_VLProcessor": "<|vision_start|><|image_pad|><|vision_end|>",
    "Qwen3VLProcessor": "<|vision_start|><|image_pad|><|vision_end|>",
}


def vl_probe_prompt(processor, vocab_size: int, *, rows: int = 2, length: int = 32, seed: int = 0):
    """`Export.probe_prompt` for a vision-language model: per row a fixed random picture (56x56 RGB, drawn from
    `seed`) marked as the processor's family expects and expanded by it, then `length` ids drawn as
    `probe_tokens` draws them, the tokenizer's added tokens (image placeholders among them) left out."""
    from PIL import Image

    g = torch.Generator().manual_seed(seed)
    mark = _PICTURE_MARKS.get(type(processor).__name__) or processor.image_token
    added = torch.tensor(
        sorted(i for i in processor.tokenizer.added_tokens_decoder if i < vocab_size), dtype=torch.long
    )
    plain = torch.ones(vocab_size, dtype=torch.bool)
    plain[added] = False
    plain = plain.nonzero().flatten()  # the ids no added token (an image placeholder among them) holds
    drawn = probe_tokens(vocab_size, rows=rows, length=length, seed=seed)
    drawn = torch.where(torch.isin(drawn, added), plain[drawn % len(plain)], drawn)
    ids, images = [], []
    for r in range(rows):
        pixels = torch.randint(0, 256, (56, 56, 3), generator=g, dtype=torch.uint8).numpy()
        picture = Image.fromarray(pixels, "RGB")
        out = processor(text=[mark], images=[[picture]], return_tensors="pt")
        tensors = {k: v for k, v in out.items() if k not in ("input_ids", "attention_mask")}
        digest = hashlib.sha256(repr(picture.size).encode() + picture.tobytes()).hexdigest()
        images.append(Images(pictures=(picture,), tensors=tensors, digest=digest))
        ids.append(out["input_ids"][0].tolist() + drawn[r].tolist())
    if len({len(row) for row in ids}) != 1:
        raise ValueError("the probe's pictures expanded to different numbers of placeholders")
    return torch.tensor(ids), tuple(images)


def probe_gap(engine_logp: Tensor, learner_logp: Tensor) -> float:
    """Mean |engine - learner| log-prob over the probe's tokens."""
    return float((engine_logp.float() - learner_logp.float()).abs().mean())


def check_probe(
    gap: float,
    bound: float,
    *,
    when: str,
    engine: str,
    accepted: float | None = None,
    at_load: bool = False,
    on: str = "the probe's fixed tokens",
) -> None:
    """Raise `WeightSyncError` when the probe's `gap` exceeds `bound` (or the gap the run `accepted`,
    `rollout.accept_engine_gap`, when that is larger). `at_load`: the engine as loaded, before any push (a gap
    there is the engine's forward; after a push it is the push). `on`: the tokens the gap was measured on (the
    fixed ones, or a batch the engine sampled: rlkit.sync.WeightSync.check_batch)."""
    limit = bound if accepted is None else max(bound, accepted)
    if gap <= limit:
        return
    if at_load:
        why = (
            "The engine's forward differs from the learner's for this model on this platform: train with "
            f"rollout.engine=hf, or accept the gap with rollout.accept_engine_gap={float(f'{gap * 1.5:.1g}')} (the run "
            "then trains on log-probs that differ by that much)"
        )
    else:
        why = "The push left the engine computing something else (stale or mangled tensors): train with rollout.engine=hf"
    raise WeightSyncError(
        f"the {engine} engine's log-probs differ from the learner's {when}: mean |dlogp| = {gap:.3g} on {on}, "
        f"above {limit:.3g} (the bound of this compute dtype"
        f"{'' if accepted is None else ' or rollout.accept_engine_gap'}). {why}"
    )
