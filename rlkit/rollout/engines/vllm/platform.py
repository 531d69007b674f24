"""What building a vLLM engine needs from the training process and does to it: the launcher's variables for
vLLM's external launcher, the side effects undone after construction, whether vLLM runs here at all (the
platform, the CPU attention's head sizes), the model's config. Used by rlkit/rollout/engines/vllm/engine.py."""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os

import torch

from rlkit.collectives import free_port
from rlkit.models import resolve_model, stateful_layers
from rlkit.rollout.engines.vllm.images import vl_refusal
from rlkit.rollout.engines.vllm.logs import quiet_build_logs

log = logging.getLogger(__name__)

LAUNCHER_KEYS = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def launcher_env() -> tuple[int, int]:
    """Set the env:// variables the external launcher reads; returns (rank, world_size)."""
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    else:
        rank, world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    local_rank = int(os.environ.get("LOCAL_RANK", rank % max(1, torch.cuda.device_count())))
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(local_rank), WORLD_SIZE=str(world))
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    if "MASTER_PORT" not in os.environ:
        os.environ["MASTER_PORT"] = str(free_port())
    return rank, world


# The environment variables that must not outlive the engine's construction: the launcher's, which
# `launcher_env` sets for vLLM's external launcher (the training process keeps its own), and LD_PRELOAD, which
# vLLM's CPU platform extends with libgomp and tcmalloc (vllm/platforms/cpu.py) and every child process (reward
# and environment workers) would inherit. Everything else vLLM sets it may read again after construction, so it
# stays: its own VLLM_* settings (e.g. VLLM_USE_BREAKABLE_CUDAGRAPH, vllm/config/vllm.py), TORCHINDUCTOR_CACHE_DIR
# for later compilations (vllm/compilation/), NCCL_GRAPH_REGISTER for the communicators of its CuMem graph pool.
RESTORED_ENV = (*LAUNCHER_KEYS, "LD_PRELOAD")


@contextlib.contextmanager
def contained_side_effects():
    """Undo what building a `vllm.LLM` does to the training process that it must not keep.

    vLLM 0.32 sets environment variables for its own start-up and later use (`RESTORED_ENV` says which are
    put back as they were; the others stay, vLLM reads them again), replaces `torch.set_num_threads` with a
    no-op on CPU, and reseeds Python's, numpy's and torch's generators (CPU, and CUDA when it is in use):
    `torch.set_num_threads` and every RNG state are restored exactly.
    """
    import random

    import numpy as np

    env = {k: os.environ.get(k) for k in RESTORED_ENV}
    set_num_threads, num_threads = torch.set_num_threads, torch.get_num_threads()
    rng = (torch.random.get_rng_state(), np.random.get_state(), random.getstate())
    # This process's CUDA generator, when it is in use (the learner's device); reading it would otherwise
    # initialise CUDA here, before vLLM chooses how.
    cuda_rng = (
        torch.cuda.get_rng_state() if torch.cuda.is_available() and torch.cuda.is_initialized() else None
    )
    try:
        yield
    finally:
        for key, value in env.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
        torch.set_num_threads = set_num_threads
        torch.set_num_threads(num_threads)
        torch.random.set_rng_state(rng[0])
        np.random.set_state(rng[1])
        random.setstate(rng[2])
        if cuda_rng is not None:
            torch.cuda.set_rng_state(cuda_rng)


def vllm_default(name: str):
    """The default of vLLM's engine argument `name` (a field of vllm.engine.arg_utils.EngineArgs)."""
    from vllm.engine.arg_utils import EngineArgs  # imported by the engine's (quiet) build already

    return next(f.default for f in dataclasses.fields(EngineArgs) if f.name == name)


@quiet_build_logs()  # the first vLLM import of a run (the start-up checks): its Triton notices
def vllm_can_run(model_path: str | None = None, dtype: str | torch.dtype | None = None) -> tuple[bool, str]:
    """(whether vLLM runs here, why or why not): a CUDA/ROCm or CPU platform, and on CPU an attention
    head size its CPU attention kernels support (vLLM 0.32: multiples of 16 from 32 to 256, and 512); for a model
    with layers that carry state across positions (a hybrid family), what `hybrid_refusal` measured; never a
    vision-language family whose images rlkit cannot pass to vLLM here (rlkit.rollout.engines.vllm.images.
    vl_refusal). `dtype`: the engine's (model.dtype), where known; None checks nothing that depends on it.

    Only a failure to import vllm reads "vllm does not import"; any other error of the check raises."""
    try:
        from vllm.platforms import current_platform
    except Exception as e:  # a broken install raises more than ImportError (e.g. torchvision ops)
        return False, f"vllm does not import ({type(e).__name__}: {e})"

    kind = current_platform.device_type
    if not (current_platform.is_cuda_alike() or current_platform.is_cpu()):
        return False, f"vLLM platform {kind!r} is neither CUDA nor CPU"
    config = hf_config(model_path) if model_path is not None else None
    if config is not None:
        refusal = hybrid_refusal(config, dtype, on_cpu=current_platform.is_cpu())
        if refusal:
            return False, refusal
    refusal = vl_refusal(config, resolve_model(model_path)[0]) if config is not None else None
    if refusal:
        return False, refusal
    if current_platform.is_cpu() and config is not None:
        from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend

        head = head_dim(config)
        if head is not None and head not in CPUAttentionBackend.get_supported_head_sizes():
            return False, f"vLLM's CPU attention does not support head_dim={head}"
    return True, f"vLLM imports and runs on its {kind} platform"


# Hybrid families vLLM 0.32's CPU build runs wrong, by the measurement that found it (tests/rollout/
# test_families.py, docs/supported-models.md): model_type -> why.
CPU_WRONG = {
    t: "vLLM 0.32's CPU rotary kernel (RotaryEmbedding.forward_cpu) rotates a [tokens, heads, head_dim] query "
    "wrongly, which is the shape vLLM's LFM2 attention gives it (a tiny LFM2's log-probs differ from the "
    "learner's by 5e-2 at fp32, at load)"
    for t in ("lfm2", "lfm2_moe")
}
# vLLM 0.32's CPU gated-DeltaNet kernels (vllm/model_executor/layers/mamba/ops/cpu/): bf16 only, and the chunked
# delta rule takes these head sizes (measured: 64 and 128 run, 32 raises "Unexpected head dim size").
CPU_GDN_HEAD_DIMS = (64, 128)


def hybrid_refusal(config, dtype=None, *, on_cpu: bool) -> str | None:
    """Why vLLM cannot run this hybrid model here (None for a model without stateful layers, or one it runs).

    Checked in order: vLLM's module for the architecture must import (vLLM 0.32's Qwen3.5 module imports its
    vision-language sibling, which needs torchvision: the CPU install has none, since PyPI's is built for
    another torch); on the CPU, the families whose kernels run them wrong (`CPU_WRONG`), and the gated-DeltaNet
    kernels' dtype and head sizes. The engine turns prefix caching off for every such model (VLLMEngine)."""
    import importlib

    stateful = stateful_layers(config)
    if not stateful:
        return None
    from vllm.model_executor.models.registry import _VLLM_MODELS

    for arch in getattr(config, "architectures", None) or []:
        module = _VLLM_MODELS.get(arch, (None,))[0]
        if module is None:
            continue
        try:
            importlib.import_module(f"vllm.model_executor.models.{module}")
        except Exception as e:  # vLLM's registry reports this as "failed to be inspected", without the cause
            why = (
                f"vLLM's module for {arch} (vllm/model_executor/models/{module}.py) does not import here: "
                f"{type(e).__name__}: {e}"
            )
            if getattr(e, "name", None) == "torchvision":
                why += " (vLLM's CPU build runs without it: PyPI's torchvision is built for another torch, see the Makefile)"
            return why
    if not on_cpu:
        return None
    text = config.get_text_config(decoder=True)
    if text.model_type in CPU_WRONG:
        return CPU_WRONG[text.model_type]
    if getattr(text, "linear_key_head_dim", None):  # gated DeltaNet (Qwen3-Next, Qwen3.5); Mamba-2 has none
        if str(dtype).removeprefix("torch.") in ("float32", "fp32", "float16", "fp16"):  # None, auto: unknown
            return (
                f"the model's gated DeltaNet layers run on vLLM's CPU kernel in bfloat16 only "
                f"(model.dtype={str(dtype).removeprefix('torch.')}): use model.dtype=bfloat16"
            )
        heads = {getattr(text, k, None) for k in ("linear_key_head_dim", "linear_value_head_dim")} - {None}
        if not heads <= set(CPU_GDN_HEAD_DIMS):
            return (
                f"vLLM's CPU gated-DeltaNet kernel takes linear-attention head sizes {list(CPU_GDN_HEAD_DIMS)}, "
                f"the model's are {sorted(heads)}"
            )
    return None


def prefix_caching(config, asked: bool | None) -> bool:
    """Whether the engine keeps a prefix cache (`rollout.engine_kwargs.enable_prefix_caching`; None = yes).

    Not for a model with layers that carry state across positions: vLLM 0.32 caches their state only in its
    "align" mode, which keeps the state of a block's last token with the block; a push leaves those states
    computed by the old weights where a later prompt with the same prefix would start from them (only the KV
    blocks are salted by policy version). Without the prefix cache vLLM runs such a model in its "none" mode,
    where every request computes its state from its own prompt (and needs no chunked prefill, which rlkit turns
    off on the CPU)."""
    stateful = stateful_layers(config)
    if not stateful:
        return True if asked is None else asked
    if asked:
        raise ValueError(
            f"rollout.engine_kwargs.enable_prefix_caching=true: the model's {'/'.join(stateful)} layers carry "
            "state across positions, and vLLM's prefix cache would keep states computed with the weights of "
            "before a push; leave it unset (off for this model) or false"
        )
    if asked is None:
        log.info(
            "vLLM prefix caching off: the model's %s layers carry state across positions, which vLLM's prefix "
            "cache would keep across weight pushes (each request prefills its prompt)", "/".join(stateful),
        )  # fmt: skip
    return False


def hf_config(model_path: str):
    from transformers import AutoConfig

    directory, gguf_file = resolve_model(model_path)
    return AutoConfig.from_pretrained(directory, **({"gguf_file": gguf_file} if gguf_file else {}))


def head_dim(config) -> int | None:
    """The attention head size of a transformers config (its language model's, for a vision-language one)."""
    config = config.get_text_config()
    head = getattr(config, "head_dim", None)
    if head is None and getattr(config, "num_attention_heads", None):
        head = config.hidden_size // config.num_attention_heads
    return head


def compiles(llm) -> bool:
    """Whether vLLM compiles the model itself (its `support_torch_compile` decoration is then in use)."""
    from vllm.config import CompilationMode

    mode = llm.llm_engine.vllm_config.compilation_config.mode
    return mode not in (CompilationMode.NONE, CompilationMode.STOCK_TORCH_COMPILE)
