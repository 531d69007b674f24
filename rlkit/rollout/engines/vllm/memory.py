"""How much of its GPU a vLLM engine takes, and whether it sleeps: colocated with a learner (sync mode) or on a
GPU of its own (an async rollout worker). Pure: vLLM's own default comes from the caller (vllm/engine.py reads it from
EngineArgs), so this module imports no vllm."""

from __future__ import annotations

# The share of its GPU the colocated engine may take (weights + KV cache): the learner needs the rest.
COLOCATED_GPU_SHARE = 0.3


def memory_plan(
    colocated: bool,
    gpu_memory_utilization: float | None,
    enable_sleep_mode: bool | None,
    *,
    sleep_available: bool,
    vllm_default: float,
) -> tuple[float, bool]:
    """(gpu_memory_utilization, enable_sleep_mode) of an engine, where the caller left them None.

    Colocated with a learner on its GPU (sync mode): `COLOCATED_GPU_SHARE` of the GPU, and sleep mode where
    the platform has it (CUDA), so that the learner gets the memory between rollouts. On a GPU of its own (an
    async rollout worker): vLLM's own default share (`vllm_default`, EngineArgs'), and no sleep mode, which would copy the
    weights and graphs to the host and back after every batch for nobody.
    """
    if gpu_memory_utilization is None:
        gpu_memory_utilization = COLOCATED_GPU_SHARE if colocated else vllm_default
    if enable_sleep_mode is None:
        enable_sleep_mode = sleep_available and colocated
    return gpu_memory_utilization, enable_sleep_mode
