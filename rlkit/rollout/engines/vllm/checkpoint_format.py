"""The learner's tensors in the checkpoint's own names and layouts, for an engine that loads checkpoints (vLLM).

transformers 5 converts some checkpoints when it loads them (mixture-of-experts experts fused into one
`experts.gate_up_proj` / `experts.down_proj` tensor, Mixtral's `block_sparse_moe` renamed `mlp`, ...) and
reverts that conversion only in `save_pretrained`. The learner's parameters carry the in-memory names; vLLM's
loaders expect what `save_pretrained` writes. `to_checkpoint` applies transformers' own reverse
(`revert_weight_conversion`, the function `save_pretrained` calls) one decoder layer at a time, so a push never
holds more than one layer twice; `checkpoint_origins` tells, for every checkpoint name, which learner tensor
it comes from (worked out once on a weightless model).
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator

import torch
from torch import Tensor

# A decoder layer's tensors (`...layers.<i>.`): the unit a conversion may span (e.g. one fused tensor per
# layer for all its experts); everything else is converted tensor by tensor.
_LAYER = re.compile(r"^(.*?\.layers\.\d+)\.")


def _group_key(name: str) -> str:
    m = _LAYER.match(name)
    return m.group(1) if m else name


def _revert(model: torch.nn.Module, group: dict[str, Tensor]) -> dict[str, Tensor]:
    from transformers.core_model_loading import revert_weight_conversion

    return revert_weight_conversion(model, group)


def to_checkpoint(
    named: Iterable[tuple[str, Tensor]], model: torch.nn.Module
) -> Iterator[tuple[str, Tensor]]:
    """`named` (in-memory names, a decoder layer's tensors consecutive, as `rlkit.weights.exported` yields
    them) in checkpoint names and layouts; `model` is the transformers model they belong to (a weightless
    copy will do: only its class and config are read)."""
    group: dict[str, Tensor] = {}
    key = None
    for name, tensor in named:
        k = _group_key(name)
        if group and k != key:
            yield from _revert(model, group).items()
            group = {}
        key = k
        group[name] = tensor
    if group:
        yield from _revert(model, group).items()


def checkpoint_origins(model: torch.nn.Module, names: Iterable[str]) -> dict[str, list[str]]:
    """{checkpoint name: the in-memory names (of `names`) it is made from}, from a weightless (meta) `model`.

    Each tensor is reverted on its own; a conversion that needs several tensors at once (none of the families
    rlkit tests) is attributed to its whole layer."""
    params = dict(model.named_parameters())
    params.update(model.named_buffers())
    groups: dict[str, list[str]] = {}
    for name in names:
        groups.setdefault(_group_key(name), []).append(name)
    origins: dict[str, list[str]] = {}
    for members in groups.values():
        try:
            for name in members:
                for ck in _revert(model, {name: params[name]}):
                    origins.setdefault(ck, []).append(name)
        except Exception:  # a many-to-one reverse: the layer's checkpoint names come from all of it
            for ck in _revert(model, {n: params[n] for n in members}):
                origins[ck] = list(members)
    return origins
