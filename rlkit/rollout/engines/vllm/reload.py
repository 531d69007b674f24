"""A weight push inside vLLM's worker, with its own accounting (vLLM 0.32's layerwise reload; vllm imported
only inside these functions, which run in the worker through `collective_rpc`).

`worker_reload` does what the worker's `reload_weights(..., is_checkpoint_format=True)` does (restore every
layer to its checkpoint layout, load, redo each layer's post-load processing once all its elements arrived,
copy the result into the kernel tensors) and also reports, from vLLM's own bookkeeping:

- `loads`: which engine parameters each checkpoint tensor was loaded into (recorded at the layers' weight
  loaders), so the push check knows which engine tensors a learner tensor determines (`rlkit.weights`);
- `missed`: layers with loadable elements that received none (vLLM then logs "Failed to load weights" and puts
  the old tensors back: they are stale), except layers whose only tensors are non-persistent buffers (a rotary
  embedding's cos/sin table, which no checkpoint holds) and the attention layers vLLM defers to the end of a
  reload (their quantization scales, which an unquantized checkpoint does not hold);
- `partial`: layers that received some of their elements only (processed with the rest stale).

Tensors no weight loader took (a loader writing with a bare `copy_`, which the layerwise reload neither counts
nor lets reach the real tensors: vLLM 0.32's gpt-oss experts, their biases and attention sinks) are loaded
again through the model's initial-load path into the live tensors, and those layers processed again
(`_load_directly`); only layers still not wholly written are reported `missed`.

On the CPU platform it then redoes, for every mixture-of-experts layer the push reloaded, the expert prepack
that vLLM's unquantized fused-MoE method applies at the first load and skips on a weight update (its
`fused_experts.process_weights_after_loading`): without it the reload copies the new weights in the checkpoint
layout into tensors the CPU kernel reads as prepacked, a silent drift of every log-prob. Likewise the plain conv weight a Mamba-2 mixer reads beside its CPU-prepacked
one (`_refresh_cpu_conv_views`).
"""

from __future__ import annotations

import functools

from rlkit.digests import tensor_digest, to_host
from rlkit.rollout.engines.vllm.content import Layouts, finish_map, held_digests, on_load, watch_processing


def _tensors(layer) -> dict:
    params = {n: p for n, p in layer._parameters.items() if p is not None}
    return params | {n: b for n, b in layer._buffers.items() if b is not None}


# The push being recorded: {"loads": {checkpoint name: engine tensors}, "current": the checkpoint name being
# loaded, "layouts": the content check's book (vllm.content.Layouts)}. Module level because a recorder stays
# installed: vLLM keeps a layer's checkpoint-layout tensors (and the loaders set on them) from one reload to the
# next, and wraps a loader only once.
_RECORDING: dict = {"loads": None, "current": None, "layouts": None}


def _record_loads(model) -> None:
    """Wrap every layer's (already wrapped) weight loaders so each call records the checkpoint tensor being
    loaded against `module.param` in `_RECORDING`. The wrapper keeps the name vLLM's layerwise reload uses to
    recognise (and later unwrap) its own loaders."""
    for path, layer in model.named_modules():
        for pname, tensor in _tensors(layer).items():
            loader = getattr(tensor, "weight_loader", None)
            if loader is None or getattr(loader, "rlkit_recorder", False):
                continue
            target = f"{path}.{pname}" if path else pname

            @functools.wraps(loader)
            def recorder(*args, _loader=loader, _target=target, **kwargs):
                if _RECORDING["loads"] is not None and _RECORDING["current"] is not None:
                    _RECORDING["loads"].setdefault(_RECORDING["current"], set()).add(_target)
                    if _RECORDING["layouts"] is not None:
                        on_load(_RECORDING["layouts"], _RECORDING["current"], _target, _loader, args, kwargs)
                return _loader(*args, **kwargs)

            recorder.rlkit_recorder = True
            tensor.weight_loader = recorder


def _tracked(weights, unrecorded: list):
    """The stream, noting the tensor being loaded; keeps those no weight loader took (`unrecorded`)."""
    for name, tensor in weights:
        _RECORDING["current"] = name
        yield name, tensor
        if name not in _RECORDING["loads"]:
            unrecorded.append((name, tensor))
    _RECORDING["current"] = None


def _written(fn) -> dict[int, int]:
    """Run `fn()`; {storage address: elements written} of every `copy_` it made."""
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode

    written: dict[int, int] = {}

    class Writes(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func is torch.ops.aten.copy_.default:
                ptr = args[0].untyped_storage().data_ptr()
                written[ptr] = written.get(ptr, 0) + args[0].numel()
            return func(*args, **(kwargs or {}))

    with Writes():
        fn()
    return written


def _load_directly(model, missed: list[str], unrecorded: list, loads: dict) -> list[str]:
    """The initial-load path for layers the layerwise reload could not count: some loaders (vLLM 0.32's gpt-oss
    experts and attention sinks) write with a bare `copy_` instead of their weight loader, which the layerwise
    reload neither sees nor lets reach the real tensors. Each such tensor (`unrecorded`) goes through the model's
    `load_weights` once more, now into the live tensors (what it wrote is recorded in `loads`), and each such
    layer's post-load processing runs again. Returns the layers still not (wholly) written."""
    owners = {}  # storage address -> (layer path, parameter name)
    for path in missed:
        for pname, p in model.get_submodule(path)._parameters.items():
            if p is not None and p.numel() > 0:
                owners[p.untyped_storage().data_ptr()] = (path, pname)
    written: dict[tuple[str, str], int] = {}
    for name, tensor in unrecorded:
        for ptr, numel in _written(lambda: model.load_weights([(name, tensor)])).items():  # noqa: B023
            if ptr in owners:
                written[owners[ptr]] = written.get(owners[ptr], 0) + numel
                loads.setdefault(name, set()).add(".".join(owners[ptr]))
    still = []
    for path in missed:
        params = {
            n: p for n, p in model.get_submodule(path)._parameters.items() if p is not None and p.numel()
        }
        if not params or any(written.get((path, n), 0) < p.numel() for n, p in params.items()):
            still.append(path)
            continue
        layer = model.get_submodule(path)
        method = getattr(layer, "quant_method", None)
        if method is not None and hasattr(method, "process_weights_after_loading"):
            method.process_weights_after_loading(layer)
    return still


def _unloaded(model) -> tuple[list[str], list[str]]:
    """(layers that received none of their loadable elements, layers that received some only), from vLLM's
    layerwise counters, before `finalize_layerwise_reload` resets them."""
    from vllm.model_executor.layers.attention import is_deferred_attention_layer
    from vllm.model_executor.model_loader.reload.layerwise import LAYERWISE_INFO

    missed, partial = [], []
    for path, layer in model.named_modules():
        info = LAYERWISE_INFO.get(layer)
        if info is None or not info.can_load() or not info.load_numel_total:
            continue
        if is_deferred_attention_layer(layer):  # its scales: vLLM restores them at the end, by design
            continue
        if info.load_numel <= 0:
            persistent = [n for n in layer._parameters] + [
                n for n in layer._buffers if n not in info.kernel_non_persistent_buffers
            ]
            if persistent:
                missed.append(path)
        elif info.load_numel < _loadable(layer, info.load_numel_total):
            partial.append(path)
    return missed, partial


def _loadable(layer, total: int) -> int:
    """The elements a checkpoint can fill in a layer of `total`: a vocabulary-parallel embedding or output head
    holds padding rows beyond the vocabulary (vLLM pads it to a multiple of 64: a tokenizer with added tokens, as
    the vision-language ones have), which no checkpoint holds and no token reads (vLLM processes such a layer at
    the end of the reload, as its own `finalize_layerwise_processing` says)."""
    from vllm.model_executor.layers.vocab_parallel_embedding import VocabParallelEmbedding

    if not isinstance(layer, VocabParallelEmbedding):
        return total
    rows = layer.shard_indices
    padding = rows.num_org_vocab_padding + rows.num_added_vocab_padding
    return total - padding * layer.embedding_dim


def _redo_cpu_expert_prepack(model, touched: set[str]) -> list[str]:
    """CPU only: the expert prepack of each reloaded fused-MoE layer (see the module docstring)."""
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return []
    done = []
    for path, layer in model.named_modules():
        kernel = getattr(getattr(layer, "quant_method", None), "moe_kernel", None)
        experts = getattr(kernel, "fused_experts", None)
        if experts is None or not any(t.startswith(f"{path}.") for t in touched):
            continue
        experts.process_weights_after_loading(layer)
        done.append(path)
    return done


def _refresh_cpu_conv_views(model, touched: set[str]) -> list[str]:
    """CPU only: the `conv_weights` of each reloaded Mamba-2 mixer (vLLM 0.32's MambaMixer2, e.g. Nemotron-H).

    The mixer registers `conv_weights` at construction as a view of `conv1d.weight` and its CPU forward reads
    it. In bf16 on a CPU with AVX512-BF16 (or aarch64 bf16) the conv weight's post-load processing replaces
    `conv1d.weight.data` with a prepacked copy and stashes the plain (dim, width) weight beside it
    (`_cpu_unpacked_conv_weight`): the view keeps the first load's values, and a push, which reprocesses the
    layer, leaves it stale (a tiny Nemotron-H's pushed engine differed from a fresh one with the same weights by
    0.1 mean |dlogp|; the digests do not see a non-persistent buffer). Copy the new plain weight into it."""
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return []
    done = []
    for path, layer in model.named_modules():
        view = layer._buffers.get("conv_weights")
        plain = getattr(getattr(layer, "conv1d", None), "_cpu_unpacked_conv_weight", None)
        if view is None or plain is None or not any(t.startswith(f"{path}.") for t in touched):
            continue
        if (
            view.shape != plain.shape
            or view.untyped_storage().data_ptr() == plain.untyped_storage().data_ptr()
        ):
            continue
        view.copy_(plain)
        done.append(path)
    return done


def worker_reload(worker, weights, layouts: Layouts | None = None, frozen: tuple[str, ...] = ()) -> dict:
    """Runs in the worker: reload `weights` (checkpoint names and layouts) in place; see the module docstring.
    With `layouts`, what each loader receives is digested there (rlkit/rollout/engines/vllm/content.py).

    Inside `set_current_vllm_config(worker.vllm_config)`, as vLLM's own `Worker.reload_weights` runs it: the
    layers' weight loaders and post-load processing (quantised methods, custom ops) read the current config, and
    vLLM 0.32's `get_current_vllm_config` asserts outside that context. `frozen`: module prefixes the push leaves
    out on purpose (a frozen vision tower, `worker_vision_prefixes`): their layers keep their tensors (vLLM puts
    the old ones back) and are not reported `missed`."""
    from vllm.config import set_current_vllm_config

    with set_current_vllm_config(worker.vllm_config):
        return _reload(worker, weights, layouts, frozen)


def worker_vision_prefixes(worker) -> list[str]:
    """Runs in the worker: the module prefixes of its model's vision tower and connector, from the model's own
    `get_mm_mapping()` (vLLM's multi-modal models); empty for a model without one."""
    model = worker.model_runner.get_model()
    if not hasattr(model, "get_mm_mapping"):
        return []
    keys = model.get_mm_mapping()
    return [p.rstrip(".") for p in [*keys.tower_model, *keys.connector]]


def _reload(worker, weights, layouts: Layouts | None, frozen: tuple[str, ...] = ()) -> dict:
    from vllm.model_executor.model_loader.reload.layerwise import (
        finalize_layerwise_reload,
        initialize_layerwise_reload,
    )

    runner = worker.model_runner
    model = runner.get_model()
    loads: dict[str, set[str]] = {}
    unrecorded: list = []
    initialize_layerwise_reload(model)
    _record_loads(model)
    if layouts is not None:
        layouts.begin()
        watch_processing(model, layouts, _RECORDING)
    _RECORDING.update(loads=loads, current=None, layouts=layouts)
    try:
        try:
            model.load_weights(_tracked(weights, unrecorded))
        finally:
            _RECORDING.update(loads=None, current=None)
        missed, partial = _unloaded(model)
        missed = [m for m in missed if not any(m == f or m.startswith(f"{f}.") for f in frozen)]
        finalize_layerwise_reload(model, worker.model_config)  # (layers processed late are still watched)
    finally:
        _RECORDING.update(layouts=None)
        if layouts is not None:
            layouts.end()
    if missed and unrecorded:
        missed = _load_directly(model, missed, unrecorded, loads)
    touched = set().union(*loads.values()) if loads else set()
    prepacked = _redo_cpu_expert_prepack(model, touched)
    conv_views = _refresh_cpu_conv_views(model, touched)
    if layouts is not None:
        # The expert prepack changes values after loading: those tensors are checked by change.
        layouts.skipped |= {t for t in layouts.shapes if any(t.startswith(f"{p}.") for p in prepacked)}
        if not layouts.mapped and not missed and not partial:
            finish_map(model, layouts)
    # (The encoder cache, image embeddings computed with the old weights, is reset by the engine through vLLM's
    # engine core, which clears the scheduler's record of it with the runner's: a runner-only reset leaves the
    # scheduler sure an image is encoded, and the next prompt with it fails "Encoder cache miss". The multi-modal
    # input cache holds processed pixels, which no weight changes.)
    if hasattr(runner, "reset_lora_state"):
        runner.reset_lora_state()
    return {"loads": {k: sorted(v) for k, v in loads.items()}, "missed": missed, "partial": partial,
            "prepacked": prepacked, "conv_views": conv_views}  # fmt: skip


def worker_close_failed_reload(worker) -> None:
    """Runs in the worker: finish the layer-by-layer reload state a failed reload left open (in vLLM's config
    context, as `worker_reload`)."""
    from vllm.config import set_current_vllm_config
    from vllm.model_executor.model_loader.reload.layerwise import finalize_layerwise_reload

    with set_current_vllm_config(worker.vllm_config):
        finalize_layerwise_reload(worker.model_runner.get_model(), worker.model_config)


def worker_tensors(worker) -> dict[str, int]:
    """Runs in the worker: {parameter or persistent buffer: numel} of its model, a tied tensor once."""
    model = worker.model_runner.get_model()
    out, seen = {}, set()
    for path, layer in model.named_modules():
        tensors = list(layer._parameters.items()) + [
            (n, b) for n, b in layer._buffers.items() if n not in layer._non_persistent_buffers_set
        ]
        for n, t in tensors:
            if t is not None and id(t) not in seen:
                seen.add(id(t))
                out[f"{path}.{n}" if path else n] = t.numel()
    return out


def worker_digests(worker, names) -> dict[str, str]:
    """Runs in the worker: the digests (rlkit.digests) of the named parameters and persistent buffers of its
    model, whole tensors as held."""
    model = worker.model_runner.get_model()
    tensors = dict(model.named_parameters(remove_duplicate=False)) | dict(
        model.named_buffers(remove_duplicate=False)
    )
    return to_host({n: tensor_digest(tensors[n]) for n in names})


def worker_held_digests(worker, layouts: Layouts) -> dict[str, str]:
    """Runs in the worker: the content check's held digests (vllm.content.held_digests)."""
    return held_digests(worker.model_runner.get_model(), layouts)


def worker_module_names(worker) -> list[str]:
    """Runs in the worker: the names of its model's modules."""
    return [name for name, _ in worker.model_runner.get_model().named_modules()]
