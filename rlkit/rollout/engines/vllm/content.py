"""What a push into vLLM must leave in the engine, and what it holds: the engine side of the content check
(issue 56; rlkit.verify.check_engine compares). Runs inside vLLM's worker (`collective_rpc`, in this process).

vLLM stacks pushed tensors (q, k and v into one `qkv_proj`, gate and up into `gate_up_proj`) and, on its CPU
backend, repacks a linear layer's weight into its kernel's own format (and empties the tensor). For every engine
tensor a push writes, two digests (rlkit.digests: a sum over positions, so pieces add up):

- expected: at the first push, every call of one of vLLM's weight loaders is made once more on a scratch copy of
  its target in which each element of the pushed tensor is replaced by its own index: the result is the layout
  map, which element of the loader's input went to which position of the target (kept as runs of consecutive
  positions). At every push each loader's input, as the loader received it, then contributes its digest at those
  positions: the engine tensor as the push's loaders wrote it, without reading the engine.
- held: the engine tensor as held after the push, at the positions its loaders wrote. A linear layer that vLLM's
  CPU backend repacked is read back from its kernel: the kernel applied to the identity matrix gives the weight
  exactly (each output element is one product with 1.0; the others are products with 0.0), in chunks of rows. A
  layer that keeps its weight and a packed copy (the output head, the embedding) is read both ways
  (`<name>` and `<name>#kernel`).

Processing that changes values after loading (the CPU fused-MoE expert prepack), found at the first push by
digesting each layer's tensors before and after vLLM's `process_weights_after_loading`, and tensors whose
loaders cannot be mapped, are left out: rlkit.verify.check_engine checks those by change, the probe by their
effect. Cost: the map, once (a scratch of 8 bytes per element of each target, one at a time, on the host); per
push, one digest of every pushed tensor and one of every engine tensor (on the device), and on the CPU backend
the identity product of every repacked linear (input size x its weight's elements multiply-adds).
"""

from __future__ import annotations

import dataclasses
import inspect
import math

import torch
from torch import Tensor

from rlkit.digests import range_digest, tensor_digest, to_host

KERNEL = "#kernel"  # suffix of the digest of a weight read back from its layer's packed kernel
MAX_RUNS = 4096  # a loader that scatters (a transpose) gives one run per element: left to the check by change
EYE_ROWS = 256  # identity rows per kernel call when reading a repacked weight back


@dataclasses.dataclass
class Layouts:
    """Per engine: the layout maps of the first push, and what each push's loaders received."""

    maps: dict = dataclasses.field(default_factory=dict)  # (ck, target, k-th call) -> [(dest, src, n)] runs
    shapes: dict = dataclasses.field(default_factory=dict)  # target -> (shape, dtype) as its loaders write it
    skipped: set = dataclasses.field(default_factory=set)  # targets left to the check by change
    kernels: set = dataclasses.field(default_factory=set)  # targets also read back from a packed kernel
    emptied: set = dataclasses.field(default_factory=set)  # targets read back from their kernel only
    spans: dict = dataclasses.field(default_factory=dict)  # target -> [(start, length)] written (once mapped)
    mapped: bool = False  # the first push's maps are complete
    expected: dict = dataclasses.field(default_factory=dict)  # target -> 0-dim digest (this push)
    calls: dict = dataclasses.field(default_factory=dict)  # (ck, target) -> calls so far (this push)
    seen: dict = dataclasses.field(
        default_factory=dict
    )  # id(tensor) -> (tensor, its digest) received this push

    def begin(self) -> None:
        self.expected, self.calls, self.seen = {}, {}, {}

    def end(self) -> None:
        self.seen = {}

    def targets(self) -> list[str]:
        return sorted(t for t in self.shapes if t not in self.skipped)

    def written(self) -> dict[str, list[tuple[int, int]]]:
        """{target: (start, length) of the positions its loaders write}, from the maps."""
        out: dict[str, list[tuple[int, int]]] = {}
        for (_, target, _), runs in self.maps.items():
            out.setdefault(target, []).extend((d, n) for d, _, n in runs)
        return {t: sorted(spans) for t, spans in out.items()}


def original_loader(loader):
    """A weight loader without vLLM's layerwise-reload wrappers (and rlkit's recorder, which keeps their name)."""
    while getattr(loader, "__name__", "") == "online_process_loader" and hasattr(loader, "__wrapped__"):
        loader = loader.__wrapped__
    return loader


def _runs(dest: Tensor, src: Tensor) -> list[tuple[int, int, int]]:
    """Runs (dest start, src start, length) where both positions advance by one."""
    if dest.numel() == 0:
        return []
    brk = torch.ones(dest.numel(), dtype=torch.bool)
    brk[1:] = (dest[1:] - dest[:-1] != 1) | (src[1:] - src[:-1] != 1)
    starts = brk.nonzero().flatten()
    ends = torch.cat([starts[1:], torch.tensor([dest.numel()])])
    return list(zip(dest[starts].tolist(), src[starts].tolist(), (ends - starts).tolist()))


def _layout_map(loader, bound: inspect.BoundArguments, names: tuple[str, str]):
    """Call `loader` as bound, on a scratch target of index -1 with the input replaced by its own indices: the
    runs of (target position, input position), or None where the loader cannot be read so."""
    param, loaded = bound.arguments[names[0]], bound.arguments[names[1]]
    scratch = torch.full(tuple(param.shape), -1, dtype=torch.int64)
    scratch.__class__ = param.__class__
    scratch.__dict__ = param.__dict__.copy()
    index = torch.arange(loaded.numel(), dtype=torch.int64).view(tuple(loaded.shape))
    args = inspect.BoundArguments(bound.signature, bound.arguments.copy())
    args.arguments[names[0]], args.arguments[names[1]] = scratch, index
    try:
        loader(*args.args, **args.kwargs)
    except Exception:
        return None
    flat = torch.Tensor.reshape(scratch.data, -1)
    dest = (flat >= 0).nonzero().flatten()
    src = flat[dest]
    if src.numel() and (int(src.max()) >= loaded.numel() or src.unique().numel() != src.numel()):
        return None
    runs = _runs(dest, src)
    return runs if len(runs) <= MAX_RUNS else None


def on_load(layouts: Layouts, ck: str, target: str, loader, args: tuple, kwargs: dict) -> None:
    """A weight loader is called for checkpoint tensor `ck` into engine tensor `target`: map it (first push) and
    add what it receives to the target's expected digest."""
    if target in layouts.skipped:
        return
    original = original_loader(loader)
    try:
        bound = inspect.signature(original).bind(*args, **kwargs)
    except TypeError:
        layouts.skipped.add(target)
        return
    bound.apply_defaults()
    names = tuple(list(bound.arguments)[:2])
    param, loaded = bound.arguments[names[0]], bound.arguments[names[1]]
    if not isinstance(loaded, Tensor) or not isinstance(param, Tensor):
        layouts.skipped.add(target)
        return
    k = layouts.calls.get((ck, target), 0)
    layouts.calls[(ck, target)] = k + 1
    key = (ck, target, k)
    if key not in layouts.maps:
        runs = None if layouts.mapped else _layout_map(original, bound, names)
        if runs is None:
            layouts.skipped.add(target)
            return
        layouts.maps[key] = runs
        layouts.shapes[target] = (tuple(param.shape), param.dtype)
    dtype = layouts.shapes[target][1]
    runs = layouts.maps[key]
    known = layouts.seen.get(id(loaded))
    if (
        known is not None
        and known[0] is loaded
        and loaded.dtype == dtype
        and runs == [(0, 0, loaded.numel())]
    ):
        part = known[1]  # the very tensor the push received, written whole at position 0: its digest already
    else:
        flat = loaded.detach().reshape(-1)
        part = sum(range_digest(flat[s : s + n].to(dtype), d) for d, s, n in runs)
    if not isinstance(part, Tensor):  # no run: nothing written
        return
    layouts.expected[target] = layouts.expected.get(target, 0) + part


def finish_map(model, layouts: Layouts) -> None:
    """After the first push: a target that no loader wrote, or written twice at one position (which the sum
    cannot tell), is left out; which targets have a packed kernel to read back is noted."""
    layouts.spans = layouts.written()
    for target in list(layouts.shapes):
        spans = layouts.spans.get(target, [])
        if not spans or any(a + n > b for (a, n), (b, _) in zip(spans, spans[1:])):
            layouts.skipped.add(target)
        path, _, name = target.rpartition(".")
        layer = model.get_submodule(path)
        if (
            name == "weight"
            and callable(getattr(layer, "cpu_linear", None))
            and len(layouts.shapes[target][0]) == 2
        ):
            layouts.kernels.add(target)
            if getattr(layer, name).numel() == 0:
                layouts.emptied.add(target)
    layouts.mapped = True


def expected_digests(layouts: Layouts) -> dict[str, str]:
    """{target (and target#kernel where it has one): digest of what this push's loaders wrote}; a target that
    no loader of this push wrote gets a digest no tensor has."""
    host = to_host(
        {t: layouts.expected[t] for t in layouts.targets() if isinstance(layouts.expected.get(t), Tensor)}
    )
    out = {t: host.get(t, "not written by this push") for t in layouts.targets()}
    return {t: d for t, d in out.items() if t not in layouts.emptied} | {
        f"{t}{KERNEL}": out[t] for t in layouts.targets() if t in layouts.kernels
    }


def unpack(layer, shape: tuple, dtype: torch.dtype) -> Tensor | None:
    """A 2-D weight [N, K] read back from `layer.cpu_linear` (vLLM's CPU linear kernel): its product with the
    identity, K rows at a time; None where the kernel does not give that shape."""
    n, k = shape
    eye = torch.eye(k, dtype=dtype)
    out = torch.empty(n, k, dtype=dtype)
    for lo in range(0, k, EYE_ROWS):
        part = layer.cpu_linear(eye[lo : lo + EYE_ROWS], layer.weight, None)
        if tuple(part.shape) != (min(EYE_ROWS, k - lo), n):
            return None
        out[:, lo : lo + EYE_ROWS] = part.t().to(dtype)
    return out


def held_forms(layer, name: str, shape: tuple, dtype: torch.dtype) -> dict[str, Tensor | None]:
    """The engine tensor `name` of `layer` as held, in the layout and dtype its loaders write: the tensor itself
    (unless emptied), and for a weight with a packed CPU kernel that kernel read back (`#kernel`)."""
    tensor = getattr(layer, name)
    forms: dict[str, Tensor | None] = {}
    if tensor.numel() == math.prod(shape):
        forms[""] = tensor.detach().reshape(shape).to(dtype)
    elif tensor.numel():
        forms[""] = None  # another size than its loaders wrote: not comparable
    if name == "weight" and callable(getattr(layer, "cpu_linear", None)) and len(shape) == 2:
        try:
            forms[KERNEL] = unpack(layer, shape, dtype)
        except Exception:
            forms[KERNEL] = None
    return forms


def held_digests(model, layouts: Layouts) -> dict[str, str]:
    """{target (and target#kernel): digest of the engine tensor as held, at the positions its loaders write}."""
    out = {}
    for target in layouts.targets():
        path, _, name = target.rpartition(".")
        shape, dtype = layouts.shapes[target]
        spans = layouts.spans[target]
        for suffix, form in held_forms(model.get_submodule(path), name, shape, dtype).items():
            if form is None:
                continue
            flat = form.reshape(-1)
            out[target + suffix] = sum(
                (range_digest(flat[d : d + n], d) for d, n in spans), torch.zeros((), dtype=torch.int64)
            )
    return to_host(out)


def watch_processing(model, layouts: Layouts, active: dict) -> None:
    """Wrap each layer's `quant_method.process_weights_after_loading` (once): while `active["layouts"]` is set
    (the first push), digest the layer's tensors before and after it; a tensor whose values it changes (held either
    way) is left out of the content check."""
    paths = {id(layer): path for path, layer in model.named_modules()}
    for layer in model.modules():
        method = getattr(layer, "quant_method", None)
        process = getattr(method, "process_weights_after_loading", None)
        if process is None or getattr(process, "rlkit_watched", False):
            continue

        def watched(lay, *a, _process=process, **kw):
            book = active.get("layouts")
            if book is None or book.mapped:
                return _process(lay, *a, **kw)
            before = {
                n: (tuple(t.shape), t.dtype, tensor_digest(t))
                for n, t in list(lay._parameters.items()) + list(lay._buffers.items())
                if t is not None and t.numel() and not t.is_meta
            }
            result = _process(lay, *a, **kw)
            for n, (shape, dtype, d) in before.items():
                forms = held_forms(lay, n, shape, dtype).values()
                if not forms or any(f is None or bool(tensor_digest(f) != d) for f in forms):
                    book.skipped.add(f"{paths.get(id(lay), '?')}.{n}")
            return result

        watched.rlkit_watched = True
        method.process_weights_after_loading = watched
