"""Model FLOPs and the device's peak: what `perf/learner_mfu` and `perf/gen_mfu` divide.

FLOPs of one sequence of T tokens through a decoder of L layers with attention width d (heads x head dim)
and N matmul parameters (every `nn.Linear` weight, the LM head included, embeddings excluded: a lookup is
not a matmul), after PaLM (Chowdhery et al. 2022, arXiv:2204.02311, appendix B):

    forward            T * (2 N + 4 L d T)        2 FLOPs per multiply-add of every weight; QK^T and AV
    forward + backward T * (6 N + 12 L d T)       the backward pass costs twice the forward

The attention term counts the whole T x T score matrix (PaLM's convention; a causal kernel does about half),
so MFU figures compare with PaLM's, torchtitan's and prime-rl's. Generation is counted as the forward of
each finished sequence (prompt + response), whatever the engine's KV cache saves.

The peak: on CUDA the datasheet's dense bf16 figure of the device (a table by name); on CPU a matmul
benchmark at the compute dtype, the best of several short runs, kept per machine in
`$RLKIT_CACHE/cpu_peak.json` with its date (the best figure ever measured for this CPU, thread count, dtype
and torch version: load can only slow a measurement down, so the best one is the honest one), measured
again once a day, and at every start while the machine is busy (a load average per core of `BUSY_LOAD` or
more: a figure measured then does not count as the day's check);
`trainer.peak_tflops` overrides both. A phase that runs faster than the peak proves the peak was measured
under load: `DevicePeak.covering` then measures again (a real measurement, not the cached figure) and raises
the peak to at least the achieved rate, with a warning, so an MFU above 1 is never logged; the raised figure
is stored, so the next runs start from it instead of repeating the warning.
"""

from __future__ import annotations

import datetime
import json
import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from rlkit.models import cache_dir

log = logging.getLogger(__name__)

MEASURED = "measured"  # how a measured peak's source begins (the trainer measures it again when disturbed)

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
        if hasattr(
            cfg, "get_text_config"
        ):  # a VL model: its language model's shape (the tower's linears count)
            cfg = cfg.get_text_config(decoder=True)
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


def measured_cpu_peak(
    dtype: torch.dtype, *, seconds: float = 0.3, size: int = 1024, runs: int = 1, pause: float = 0.05
) -> float:
    """FLOP/s of the best `size` x `size` matmul at `dtype` on this CPU (all threads): the best of `runs`
    runs of about `seconds` each, `pause` seconds apart (a burst of load on the machine spoils one run, not
    the best of several)."""
    a = torch.randn(size, size).to(dtype)
    b = torch.randn(size, size).to(dtype)
    torch.mm(a, b)  # warm-up
    best = 0.0
    for i in range(runs):
        if i:
            time.sleep(pause)
        deadline = time.perf_counter() + seconds
        while time.perf_counter() < deadline:
            start = time.perf_counter()
            torch.mm(a, b)
            best = max(best, 2.0 * size**3 / (time.perf_counter() - start))
    return best


def _cpu_key(dtype: torch.dtype) -> str:
    name = ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                name = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    import platform

    name = name or platform.processor() or platform.machine()
    return f"{name} | {torch.get_num_threads()} threads | {dtype} | torch {torch.__version__}"


BUSY_LOAD = 0.5
"""A load average per core (1 minute) from which the machine counts as busy: a CPU peak measured then is used
and stored (if it is the best) but does not count as the day's check, so the next start measures again."""


def machine_busy() -> bool:
    """True when the 1-minute load average per core is `BUSY_LOAD` or more (False where it cannot be read)."""
    try:
        return os.getloadavg()[0] / (os.cpu_count() or 1) >= BUSY_LOAD
    except OSError:
        return False


def cached_cpu_peak(
    dtype: torch.dtype, *, path: Path | None = None, fresh: bool = False, at_least: float = 0.0, **measure
) -> tuple[float, str]:
    """(peak FLOP/s, where it comes from): the best of the figure stored for this machine in `path` (default
    `$RLKIT_CACHE/cpu_peak.json`), a fresh `measured_cpu_peak` (best of 5 runs) and `at_least` (a rate a
    phase achieved), measured once a day: an entry already checked today is taken as it is (the measurement
    costs ~0.8 s of every run's start, all cores busy), unless `fresh`. A measurement on a busy machine
    (`machine_busy`) does not count as the check. A higher figure replaces the stored one with its date. An
    unwritable cache only loses the memory, never the run."""
    path = Path(path) if path is not None else cache_dir() / "cpu_peak.json"
    key, today = _cpu_key(dtype), datetime.date.today().isoformat()
    try:
        table = json.loads(path.read_text()) if path.is_file() else {}
    except (OSError, ValueError):
        table = {}
    cached = table.get(key) or {}
    stored = f"measured: the best {dtype} matmul on this CPU ({cached.get('date')}, {path})"
    if not fresh and cached.get("checked") == today and cached.get("flops", 0.0) > 0:
        return cached["flops"], stored
    busy = machine_busy()
    now = max(measured_cpu_peak(dtype, **{"runs": 5, "seconds": 0.1, **measure}), at_least)
    higher = now > cached.get("flops", 0.0)
    table[key] = {"flops": now, "date": today} if higher else dict(cached)
    if not busy:
        table[key]["checked"] = today
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(table, indent=1))
        tmp.replace(path)
    except OSError as e:
        log.debug("cannot store the CPU peak in %s: %s", path, e)
    if higher:
        return now, f"measured: {dtype} matmul on this CPU, best of 5 runs now"
    return cached["flops"], stored


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
    return cached_cpu_peak(dtype)


class DevicePeak:
    """The peak FLOP/s of one device that MFU divides by, raised when a phase proves it too low.

    `remeasure(achieved)` (called when a phase ran faster than the peak, with that rate) returns a fresh
    measurement (and may store the higher of the two: `cached_cpu_peak(fresh=True, at_least=achieved)`), or
    None where there is nothing to measure (a datasheet figure, `trainer.peak_tflops`)."""

    def __init__(self, flops: float, source: str, remeasure: Callable[[float], float | None] | None = None):
        self.flops, self.source, self.remeasure = flops, source, remeasure

    def covering(self, achieved: float) -> float:
        """The peak, first raised to at least `achieved` FLOP/s of one device (with a warning) when a phase
        ran faster than it: a measurement taken under load. Every MFU divided by it is then at most 1."""
        if not achieved > self.flops:  # NaN peaks (unknown GPU) stay NaN
            return self.flops
        fresh = self.remeasure(achieved) if self.remeasure is not None else None
        new = max(achieved, fresh or 0.0)
        log.warning(
            "a phase ran at %.3g TFLOP/s per device, above the peak of %.3g TFLOP/s (%s): the peak measurement "
            "was disturbed (load on the machine) or the figure is too low; MFU is now against %.3g TFLOP/s%s",
            achieved / 1e12, self.flops / 1e12, self.source, new / 1e12,
            " (measured again)" if fresh else "; set trainer.peak_tflops to the device's real peak",
        )  # fmt: skip
        self.flops = new
        self.source = f"raised at run time ({'measured again' if fresh else 'the achieved rate'})"
        return self.flops


# The generation counters of a step's statistics (rlkit.metrics.step_statistics) that only the rates below read.
GEN_COUNTERS = ("gen_tokens", "gen_seq_tokens", "gen_seq_tokens_sq")


def step_rates(
    metrics: dict[str, float], elapsed: float, *, shape: ModelShape, world: int, peak: DevicePeak
) -> dict[str, float]:
    """A step's throughput and MFU from its host metrics (the `GEN_COUNTERS`, `learner/flops`,
    `learner/seconds`, `timing/generate_s`) and its wall time `elapsed`: `perf/tokens_per_s`,
    `perf/gen_tokens_per_s`, `perf/gen_mfu`, `perf/learner_mfu`, and `timing/step_s`.

    MFU is model FLOPs over the peak of every device for the phase's wall time (rates per device; a rate
    above the peak means the peak was measured under load: `DevicePeak.covering` raises it)."""
    tokens, seq, seq_sq = (metrics[k] for k in GEN_COUNTERS)
    gen_s = max(metrics["timing/generate_s"], 1e-9)
    gen_rate = batch_flops(shape, seq, seq_sq, training=False) / (gen_s * world)
    learn_rate = metrics["learner/flops"] / (max(metrics["learner/seconds"], 1e-9) * world)
    top = peak.covering(max(gen_rate, learn_rate))
    return {
        "timing/step_s": elapsed,
        "perf/tokens_per_s": tokens / max(elapsed, 1e-9),
        "perf/gen_tokens_per_s": tokens / gen_s,
        "perf/gen_mfu": gen_rate / top,
        "perf/learner_mfu": learn_rate / top,
    }
