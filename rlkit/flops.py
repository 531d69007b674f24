"""Model FLOPs and the device's peak: what `perf/learner_mfu` and `perf/gen_mfu` divide.

FLOPs of one sequence of T tokens through a decoder of L layers with attention width d (heads x head dim)
and N matmul parameters (every `nn.Linear` weight, the LM head included, embeddings excluded: a lookup is
not a matmul), after PaLM (Chowdhery et al. 2022, arXiv:2204.02311, appendix B):

    forward            T * (2 N + 4 L d T)        2 FLOPs per multiply-add of every weight; QK^T and AV
    forward + backward T * (6 N + 12 L d T)       the backward pass costs twice the forward

The attention term counts the whole T x T score matrix (PaLM's convention; a causal kernel does about half),
so MFU figures compare with PaLM's, torchtitan's and prime-rl's. Generation is counted as the forward of
each finished sequence (prompt + response), whatever the engine's KV cache saves.

The peak: on CUDA the datasheet's dense bf16 figure of the device (a table by name), on CPU measured once by
a short matmul benchmark at the compute dtype; `trainer.peak_tflops` overrides both.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

# Dense bf16 tensor-core peaks from the vendors' datasheets, TFLOP/s (no sparsity), by a substring of the name.
CUDA_PEAK_TFLOPS = (
    ("B200", 2250.0),
    ("H200", 989.4),
    ("H100 PCIe", 756.0),
    ("H100", 989.4),
    ("H800", 989.4),
    ("A100", 312.0),
    ("A800", 312.0),
    ("L40S", 362.1),
    ("L40", 181.0),
    ("L4", 121.0),
)


@dataclass(frozen=True)
class ModelShape:
    """What the FLOP count needs of a model."""

    matmul_params: int
    """N: parameters of every nn.Linear weight (LM head included), embeddings and norms excluded."""
    layers: int
    attention_width: int
    """d: attention heads x head dimension."""

    @classmethod
    def of(cls, model: torch.nn.Module) -> ModelShape:
        cfg = model.config
        heads = cfg.num_attention_heads
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
        linear = sum(m.weight.numel() for m in model.modules() if isinstance(m, torch.nn.Linear))
        return cls(int(linear), int(cfg.num_hidden_layers), int(heads * head_dim))


def sequence_flops(shape: ModelShape, length: int, *, training: bool) -> float:
    """FLOPs of one sequence of `length` tokens (see the module docstring)."""
    c = 6.0 if training else 2.0
    return length * (c * shape.matmul_params + 2 * c * shape.layers * shape.attention_width * length)


def batch_flops(shape: ModelShape, tokens: float, tokens_sq: float, *, training: bool) -> float:
    """`sequence_flops` summed over a batch, from the sums of its sequences' lengths and squared lengths."""
    c = 6.0 if training else 2.0
    return c * shape.matmul_params * tokens + 2 * c * shape.layers * shape.attention_width * tokens_sq


def measured_cpu_peak(dtype: torch.dtype, *, seconds: float = 0.3, size: int = 1024) -> float:
    """FLOP/s of the best `size` x `size` matmul at `dtype` over about `seconds` on this CPU (all threads)."""
    a = torch.randn(size, size).to(dtype)
    b = torch.randn(size, size).to(dtype)
    torch.mm(a, b)  # warm-up
    best, deadline = 0.0, time.perf_counter() + seconds
    while time.perf_counter() < deadline:
        start = time.perf_counter()
        torch.mm(a, b)
        best = max(best, 2.0 * size**3 / (time.perf_counter() - start))
    return best


def device_peak(
    device: torch.device, dtype: torch.dtype, override_tflops: float | None = None
) -> tuple[float, str]:
    """(peak FLOP/s of one device, where the figure comes from)."""
    if override_tflops is not None:
        return override_tflops * 1e12, "trainer.peak_tflops"
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        for key, tflops in CUDA_PEAK_TFLOPS:
            if key in name:
                return tflops * 1e12, f"datasheet bf16 dense peak of {key}"
        return float("nan"), f"no datasheet peak for {name!r}: set trainer.peak_tflops"
    return measured_cpu_peak(dtype), f"measured {dtype} matmul on this CPU"
