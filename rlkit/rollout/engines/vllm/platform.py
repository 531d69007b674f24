"""What building a vLLM engine needs from the training process and does to it: the launcher's variables for
vLLM's external launcher, the side effects undone after construction, whether vLLM runs here at all (the
platform, the CPU attention's head sizes), the model's config. Used by rlkit/rollout/engines/vllm/engine.py."""

from __future__ import annotations

import contextlib
import dataclasses
import os

import torch

from rlkit.collectives import free_port
from rlkit.models import resolve_model, stateful_layers
from rlkit.rollout.engines.vllm.images import vl_refusal
from rlkit.rollout.engines.vllm.logs import quiet_build_logs

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
def vllm_can_run(model_path: str | None = None) -> tuple[bool, str]:
    """(whether vLLM runs here, why or why not): a CUDA/ROCm or CPU platform, and on CPU an attention
    head size its CPU attention kernels support (vLLM 0.32: multiples of 16 from 32 to 256, and 512); never a
    model with layers that carry state across positions (hybrid families: see the message), nor a vision-language
    family whose images rlkit cannot pass to vLLM here (rlkit.rollout.engines.vllm.images.vl_refusal).

    Only a failure to import vllm reads "vllm does not import"; any other error of the check raises."""
    try:
        from vllm.platforms import current_platform
    except Exception as e:  # a broken install raises more than ImportError (e.g. torchvision ops)
        return False, f"vllm does not import ({type(e).__name__}: {e})"

    kind = current_platform.device_type
    if not (current_platform.is_cuda_alike() or current_platform.is_cpu()):
        return False, f"vLLM platform {kind!r} is neither CUDA nor CPU"
    config = hf_config(model_path) if model_path is not None else None
    stateful = stateful_layers(config) if config is not None else []
    if stateful:
        return False, (
            f"the model's {'/'.join(stateful)} layers carry a recurrent or convolution state (a hybrid family), "
            "which rlkit does not yet run on vLLM: vLLM 0.32 needs chunked prefill for such a cache (rlkit turns "
            "it off for whole, seeded prefills) and its prefix cache would keep states computed with the weights "
            "of before a push; the HF engine trains these families"
        )
    refusal = vl_refusal(config, resolve_model(model_path)[0]) if config is not None else None
    if refusal:
        return False, refusal
    if current_platform.is_cpu() and config is not None:
        from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend

        head = head_dim(config)
        if head is not None and head not in CPUAttentionBackend.get_supported_head_sizes():
            return False, f"vLLM's CPU attention does not support head_dim={head}"
    return True, f"vLLM imports and runs on its {kind} platform"


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
