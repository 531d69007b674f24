"""LoRA adapters for the policy (peft), and the merged weights the rollout engines receive.

With `model.lora.rank > 0` the learner wraps the policy with peft's LoRA: only the adapters train (and
have optimizer state); the base weights stay frozen in the compute dtype. The reference model of the
KL loss is the same model with its adapters switched off, so no second copy is loaded.

The engines never see adapters: `merged_weights` turns the learner's parameter stream into the base
model's names and shapes, each adapted linear layer merged out of place as `W + (alpha / rank) B A`.
So the engine's manifest check is unchanged, and the weight-sync check (`mismatch/kl` at step 0 and
after the first push) proves the adapter arrived: a push that dropped it leaves the engine on the base.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Iterator

import torch
from torch import Tensor

from rlkit.config.schema import ConfigError
from rlkit.models import resolve_model

log = logging.getLogger(__name__)

PEFT_PREFIX = "base_model.model."
_BASE = ".base_layer."
_ADAPTER_PARTS = (".lora_A.", ".lora_B.")


def add_adapters(model: torch.nn.Module, lora, *, gradient_checkpointing: bool = False) -> torch.nn.Module:
    """`model` wrapped by peft with LoRA adapters of `lora` (the `model.lora` config); only the adapters
    require grad."""
    from peft import LoraConfig, get_peft_model

    targets = list(lora.target_modules)
    if getattr(model.config, "vision_config", None) is not None and hasattr(model, "get_image_features"):
        targets = language_model_targets(model, targets)
    config = LoraConfig(
        r=lora.rank,
        lora_alpha=lora.alpha,
        lora_dropout=lora.dropout,
        target_modules=targets,
        bias="none",
    )
    peft_model = get_peft_model(model, config)
    if gradient_checkpointing:  # inputs of a frozen embedding need grad for checkpointed blocks
        peft_model.enable_input_require_grads()
    return peft_model


LANGUAGE_MODELS = ("language_model", "text_model")
"""The module of a vision-language model that holds its language model (Idefics3 / SmolVLM: text_model)."""


def language_model_targets(model: torch.nn.Module, targets: list[str]) -> list[str]:
    """A vision-language model's LoRA targets: the full names of the linear layers of its language model that
    `targets` name (by last part, or all-linear), so that the vision tower (whose MLPs share names such as
    gate_proj with the language model's) gets no adapter."""
    names = [
        name for name, module in model.named_modules()
        if isinstance(module, torch.nn.Linear) and any(f".{lm}." in f".{name}." for lm in LANGUAGE_MODELS)
        and ("all-linear" in targets or name.rsplit(".", 1)[-1] in targets)
    ]  # fmt: skip
    if not names:
        raise ConfigError(
            f"model.lora.target_modules={targets!r} names no linear layer of the language model"
        )
    return names


def base_name(name: str) -> str | None:
    """The base model's name of a peft parameter name; None for an adapter parameter."""
    if any(part in name for part in _ADAPTER_PARTS):
        return None
    name = name.removeprefix(PEFT_PREFIX)
    return name.replace(_BASE, ".")


def base_manifest(manifest: dict[str, tuple]) -> dict[str, tuple]:
    """A peft model's manifest (name -> shape) as the base model's: adapters left out, names unwrapped."""
    out = {}
    for name, shape in manifest.items():
        base = base_name(name)
        if base is not None:
            out[base] = shape
    return out


def merged_weights(named: Iterable[tuple[str, Tensor]], *, scale: float) -> Iterator[tuple[str, Tensor]]:
    """(base name, tensor) for a stream of a peft model's (name, full tensor): every adapted layer's
    weight merged as `W + scale * B @ A` (new tensors; the model is not touched), adapters not yielded.

    The stream may hold a layer's base weight and its A and B in any order: each layer's pieces are
    held until all three have arrived (at most one layer's worth in practice: they are neighbours)."""
    pending: dict[str, dict[str, Tensor]] = {}
    for name, tensor in named:
        for part, key in ((".base_layer.weight", "W"), (".lora_A.", "A"), (".lora_B.", "B")):
            if part in name:
                layer = name[: name.index(part)]
                pieces = pending.setdefault(layer, {})
                pieces[key] = tensor
                if len(pieces) == 3:
                    del pending[layer]
                    w, a, b = pieces["W"], pieces["A"], pieces["B"]
                    delta = (b.float() @ a.float()) * scale
                    yield base_name(layer + ".weight"), (w.float() + delta).to(w.dtype)
                break
        else:
            yield base_name(name), tensor
    if pending:
        raise RuntimeError(
            f"LoRA merge: incomplete layers {sorted(pending)[:3]} (base weight, A and B expected)"
        )


def check_config(cfg) -> None:
    """`model.lora.*` beyond ranges: the target modules name at least one layer (raises ConfigError)."""

    targets = list(cfg.model.lora.target_modules)
    if not targets or not all(isinstance(x, str) and x for x in targets):
        raise ConfigError(
            f"model.lora.target_modules={targets!r} must be a non-empty list of module names, e.g. [q_proj, v_proj]"
        )
    if cfg.model.lora.rank == 0:
        return
    try:
        layers = adaptable_layers(cfg.model.path)
    except (OSError, ValueError) as e:  # no config to read here (offline hub id): the model load will say
        log.warning(
            "model.lora.target_modules not checked: the config of %r does not load (%s)", cfg.model.path, e
        )
        return
    names = sorted({name.rsplit(".", 1)[-1] for name in layers})
    for t in targets:
        if t != "all-linear" and not any(name == t or name.endswith("." + t) for name in layers):
            raise ConfigError(
                f"model.lora.target_modules: {t!r} names no linear layer of model.path={cfg.model.path!r}: "
                f"valid {names} (or all-linear)"
            )


def adaptable_layers(model_path: str) -> list[str]:
    """The names of the policy's linear layers (what peft's `target_modules` match, by name or suffix), read
    from the model's config: the model is built on the meta device, no weight is loaded."""
    from transformers import AutoConfig, AutoModelForCausalLM

    directory, gguf_file = resolve_model(model_path)
    config = AutoConfig.from_pretrained(directory, **({"gguf_file": gguf_file} if gguf_file else {}))
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    return [name for name, m in model.named_modules() if isinstance(m, torch.nn.Linear)]
