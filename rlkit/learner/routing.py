"""Rollout Routing Replay: the learner's MoE routers take the top-k experts the engine chose.

Per MoE layer, the expert indices of each token come from outside (the engine's routes); the routing weights
are still the learner's own: its router's softmax gathered at the replayed indices and renormalised the way the
model's code does, so the router's gradient flows as usual. Done with forward hooks on the router modules
transformers exposes (`Qwen3MoeTopKRouter`, `MixtralTopKRouter`: they return (logits, weights, indices)), not a
copy of the modeling code.

    hooks = RouterHooks(model)             # once; hooks stay installed and do nothing outside the contexts
    with hooks.record() as routes: model(...)   # routes.tensor(): [B, S, L, k] the model's own choice
    with hooks.replay(routes):             # forward AND backward inside (gradient checkpointing recomputes)
        loss = ...; loss.backward()

Routes are laid out like the input ids: [rows, columns, MoE layers, k], one entry per token the model sees
(prompt and response); the router flattens [rows, columns] row-major, and so does the hook.
"""

from __future__ import annotations

import importlib.util
import logging
import os
import weakref
from contextlib import contextmanager

import torch
from torch import Tensor, nn

from rlkit.config.schema import ConfigError
from rlkit.models import resolve_model


def _renormalises(router: nn.Module) -> bool:
    """Whether the model's own router divides its top-k probabilities by their sum."""
    return bool(getattr(router, "norm_topk_prob", True))  # Mixtral always renormalises; Qwen3-MoE by config


# router classes whose forward is (softmax over experts, top-k, optional renormalisation) -> (logits, w, idx)
ROUTERS = {"Qwen3MoeTopKRouter": _renormalises, "MixtralTopKRouter": _renormalises}


def moe_routers(model: nn.Module) -> list[nn.Module]:
    """The model's router modules in layer order (empty for a dense model or an unsupported MoE)."""
    return [m for m in model.modules() if type(m).__name__ in ROUTERS]


def replay_weights(logits: Tensor, indices: Tensor, renormalise: bool) -> Tensor:
    """The routing weights of replayed experts: softmax(logits) in fp32 at `indices`, renormalised over k."""
    probs = torch.softmax(logits.float(), dim=-1)
    weights = probs.gather(-1, indices)
    return weights / weights.sum(dim=-1, keepdim=True) if renormalise else weights


class RouterHooks:
    """Forward hooks on every router of `model`: record the routes it takes, or replay given ones."""

    def __init__(self, model: nn.Module):
        self.routers = moe_routers(model)
        if not self.routers:
            raise ValueError(
                "algo.routing_replay: the model has no MoE router rlkit can replay "
                f"(supported router classes: {sorted(ROUTERS)})"
            )
        self._replay: Tensor | None = None
        self._recorded: list[Tensor] | None = None
        self._handles = [r.register_forward_hook(self._hook(i, r)) for i, r in enumerate(self.routers)]

    @property
    def layers(self) -> int:
        return len(self.routers)

    def remove(self) -> None:
        for h in self._handles:
            h.remove()

    def _hook(self, layer: int, router: nn.Module):
        renormalise = ROUTERS[type(router).__name__](router)

        def hook(module, args, output):
            logits, weights, indices = output
            if self._recorded is not None:
                self._recorded.append(indices.detach())
            if self._replay is None:
                return None
            k = indices.shape[-1]
            routes = self._replay[..., layer, :].reshape(-1, k).to(device=indices.device, dtype=torch.long)
            if (
                routes.shape == indices.shape
            ):  # -1: no engine route (padding, the last token): the learner's own
                routes = torch.where(routes >= 0, routes, indices)
            else:
                raise ValueError(
                    f"routing replay: routes for {routes.shape[0]} tokens x {routes.shape[1]} experts, "
                    f"but MoE layer {layer} routes {indices.shape[0]} x {k} (the routes must be laid out as "
                    "the input ids: [rows, columns, MoE layers, k])"
                )
            new = replay_weights(logits, routes, renormalise).to(weights.dtype)
            return logits, new, routes

        return hook

    def set(self, routes: Tensor | None) -> None:
        """Every forward from now on replays `routes` [rows, columns, layers, k] (None: the model routes), until
        the next `set`: so the recomputation of a gradient-checkpointed forward, in the backward after it,
        replays them too. Entries -1 leave the router's own choice (positions the engine did not route)."""
        if routes is not None and (routes.dim() != 4 or routes.shape[2] != self.layers):
            raise ValueError(
                f"routing replay: routes of shape {tuple(routes.shape)}; expected [rows, columns, {self.layers}, k] "
                f"(the model has {self.layers} MoE layers)"
            )
        self._replay = routes

    @contextmanager
    def replay(self, routes: Tensor):
        """Within the context, every router uses `routes` (see `set`; forward and backward inside)."""
        self.set(routes)
        try:
            yield
        finally:
            self._replay = None

    @contextmanager
    def record(self):
        """Record the routes of the forwards inside; `.tensor(rows, columns)` gives [rows, columns, L, k]."""
        rec = _Recording(self)
        self._recorded = rec.chunks
        try:
            yield rec
        finally:
            self._recorded = None


class _Recording:
    def __init__(self, hooks: RouterHooks):
        self.hooks = hooks
        self.chunks: list[Tensor] = []

    def tensor(self, rows: int, columns: int) -> Tensor:
        """The routes of the last forward, [rows, columns, layers, k] (int16: expert ids fit)."""
        layers = self.hooks.layers
        last = self.chunks[-layers:]
        return torch.stack(last, dim=1).reshape(rows, columns, layers, -1).to(torch.int16)


_INSTALLED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def install(model: nn.Module) -> RouterHooks:
    """Hooks on `model`'s routers, found again by `set_routes(model, ...)` (once per model)."""
    if model not in _INSTALLED:
        _INSTALLED[model] = RouterHooks(model)
    return _INSTALLED[model]


def set_routes(model: nn.Module, routes: Tensor | None) -> None:
    """The routes `model`'s next forwards replay (`RouterHooks.set`); a model without hooks (the reference, a
    teacher, replay off) routes on its own."""
    hooks = _INSTALLED.get(model)
    if hooks is not None:
        hooks.set(routes)


def check_config(cfg) -> None:
    """`algo.routing_replay=true` needs routes (vLLM with its Model Runner V2, which needs Triton: CUDA builds;
    single-turn episodes) and a model with routers rlkit replays; LoRA and FSDP2 are not supported with it yet
    (raises ConfigError before any model loads)."""
    if not cfg.algo.routing_replay:
        return
    key = "algo.routing_replay=true"
    if cfg.rollout.engine != "vllm":
        raise ConfigError(
            f"{key} needs rollout.engine=vllm (got {cfg.rollout.engine!r}): only vLLM returns the experts it "
            "routed each token to; or set algo.routing_replay=false"
        )
    if importlib.util.find_spec("triton") is None or os.environ.get("VLLM_USE_V2_MODEL_RUNNER") == "0":
        raise ConfigError(
            f"{key}: vLLM returns routed experts only from its Model Runner V2, which needs Triton (a CUDA build; "
            "vLLM's CPU build has none) and VLLM_USE_V2_MODEL_RUNNER not 0; or set algo.routing_replay=false"
        )
    for bad, why in (
        (cfg.model.lora.rank > 0, f"model.lora.rank={cfg.model.lora.rank} (LoRA)"),
        (cfg.trainer.strategy == "fsdp2", "trainer.strategy=fsdp2"),
        (cfg.env.name != "single_turn", f"env.name={cfg.env.name!r} (multi-turn episodes)"),
    ):
        if bad:
            raise ConfigError(f"{key} is not supported with {why} yet; set algo.routing_replay=false")
    try:
        routers = model_routers(cfg.model.path)
    except (OSError, ValueError) as e:  # no config to read here: the learner's RouterHooks will refuse it
        logging.getLogger(__name__).warning(
            "%s not checked: the config of %r does not load (%s)", key, cfg.model.path, e
        )
        return
    if not routers:
        raise ConfigError(
            f"{key}: model.path={cfg.model.path!r} has no mixture-of-experts router rlkit replays (a dense model, "
            f"or an MoE family without support; supported routers: {sorted(ROUTERS)}); set algo.routing_replay=false"
        )


def model_routers(model_path: str) -> list[str]:
    """The class names of the replayable routers of the model at `model_path`, from its config (meta device)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    directory, gguf_file = resolve_model(model_path)
    config = AutoConfig.from_pretrained(directory, **({"gguf_file": gguf_file} if gguf_file else {}))
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    return [type(m).__name__ for m in moe_routers(model)]
