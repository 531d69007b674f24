"""The data-parallel strategy: accelerate's `Accelerator` for FSDP2, DDP or one plain process, on CUDA or
on CPU over gloo; the only module that sets accelerate up. `check_config` owns `model.dtype`,
`trainer.device` and `trainer.strategy`; `resolve_dtypes` turns `model.dtype=auto` into the machine's fast dtype.
"""

from __future__ import annotations

import logging

import torch

from rlkit.collectives import let_nccl_timeouts_reach_python
from rlkit.config.rules import choice
from rlkit.config.schema import ConfigError

STRATEGIES = ("auto", "fsdp2", "ddp")  # trainer.strategy
DEVICES = ("auto", "cpu", "cuda")  # trainer.device
DTYPES = (
    "auto",
    "float32",
    "bfloat16",
)  # model.dtype (float16 would need loss scaling, which the learner does not do)
# /proc/cpuinfo flags of native bf16: x86 (AVX-512 BF16, AMX), aarch64 (FEAT_BF16)
CPU_BF16_FLAGS = ("avx512_bf16", "amx_bf16", "bf16")

log = logging.getLogger(__name__)


def cpu_has_bf16(cpuinfo: str | None = None) -> bool:
    """Whether this CPU computes bf16 natively (a flag of `CPU_BF16_FLAGS` in /proc/cpuinfo).

    Without it PyTorch and vLLM emulate bf16 matmuls with fp32 instructions plus conversions: on an
    AVX-512 Xeon without AVX512_BF16 a bf16 matmul ran ~5x slower than fp32 (docs/benchmarks.md).
    """
    if cpuinfo is None:
        try:
            with open("/proc/cpuinfo") as f:
                cpuinfo = f.read()
        except OSError:  # not Linux: no way to tell, so the safe choice
            return False
    flags = set()
    for line in cpuinfo.splitlines():
        key, _, value = line.partition(":")
        if key.strip() in ("flags", "Features"):
            flags.update(value.split())
    return any(f in flags for f in CPU_BF16_FLAGS)


def fast_dtype(device: str) -> str:
    """`model.dtype=auto`: bfloat16 where the hardware computes it natively (a CUDA GPU with bf16, a CPU with a
    flag of `CPU_BF16_FLAGS`), else float32."""
    if device != "cpu" and torch.cuda.is_available():
        return "bfloat16" if torch.cuda.is_bf16_supported() else "float32"
    return "bfloat16" if cpu_has_bf16() else "float32"


def resolve_dtypes(cfg) -> None:
    """Replace `auto` in `model.dtype` (and `model.compute_dtype`, where auto means "as model.dtype") by a
    concrete dtype, once, before anything reads them; the run's config.json records the choice."""
    m = cfg.model
    if m.dtype == "auto":
        m.dtype = fast_dtype(cfg.trainer.device)
    if m.compute_dtype == "auto":
        m.compute_dtype = m.dtype


def resolve_strategy(strategy: str, *, cuda: bool, world_size: int) -> str:
    """The data-parallel wrapper actually used: "fsdp2", "ddp" or "none".

    "auto" is FSDP2 on CUDA and DDP over gloo for several CPU processes. One process has nothing to
    shard or average: it runs plain whatever was asked (as accelerate does with one GPU).
    """
    if strategy not in STRATEGIES:
        raise ValueError(f"trainer.strategy={strategy!r} is not valid; choose one of {list(STRATEGIES)}")
    if world_size == 1:
        return "none"
    if strategy == "auto":
        return "fsdp2" if cuda else "ddp"
    return strategy


def make_accelerator(cfg):
    """The accelerate `Accelerator` of `trainer.strategy` (see `resolve_strategy`), on CUDA or on CPU over gloo.

    FSDP2 is accelerate's own: `prepare`, `clip_grad_norm_`, `get_state_dict`, `save_state` and
    `load_state` run its FSDP2 branches (DTensor shards, DCP sharded checkpoints) on CPU as on CUDA.
    accelerate 1.15 turns its FSDP plugin on only for multi-accelerator process groups, never for
    MULTI_CPU (`AcceleratorState.__init__`). On CPU `enable_fsdp_on_cpu` therefore runs the same three
    assignments accelerate runs for a GPU group; nothing else is patched. What differs from CUDA:
    the collectives go over gloo instead of NCCL, and bf16 runs on the CPU's bf16 kernels.

    Precision: bf16 compute keeps fp32 master weights, gradients and optimizer state (FSDP2's
    MixedPrecisionPolicy; accelerate's autocast of the model's forward otherwise, on CPU too). It is on with
    `model.compute_dtype=bfloat16`, and by default (null) with `model.dtype=bfloat16` on CUDA or under FSDP2.
    """
    from datetime import timedelta

    from accelerate import Accelerator, FullyShardedDataParallelPlugin, PartialState

    # trainer.device=cpu keeps the learner on the CPU (gloo) on a machine with GPUs: accelerate's `cpu=True`.
    cuda = cfg.trainer.device != "cpu" and torch.cuda.is_available()
    # PartialState joins the process group (gloo on CPU) and is shared by the Accelerator built below.
    # A bounded wait in every collective: a stopped rank must not hang the others (gloo and NCCL honour it).
    timeout = timedelta(seconds=cfg.trainer.collective_timeout_s)
    if cuda and (replaced := let_nccl_timeouts_reach_python()) is not None:
        log.debug(
            "TORCH_NCCL_ASYNC_ERROR_HANDLING=%r -> 2: NCCL timeouts reach rlkit's explanation", replaced
        )
    world_size = PartialState(cpu=not cuda, timeout=timeout).num_processes
    strategy = resolve_strategy(cfg.trainer.strategy, cuda=cuda, world_size=world_size)
    compute = cfg.model.compute_dtype
    bf16 = (
        compute == "bfloat16"
        if compute is not None
        else cfg.model.dtype == "bfloat16" and (cuda or strategy == "fsdp2")
    )
    mixed_precision = "bf16" if bf16 else "no"
    if strategy != "fsdp2":
        return Accelerator(cpu=not cuda, mixed_precision=mixed_precision)
    plugin = FullyShardedDataParallelPlugin(
        fsdp_version=2,
        auto_wrap_policy="transformer_based_wrap",
        reshard_after_forward=True,
        state_dict_type="SHARDED_STATE_DICT",
    )
    acc = Accelerator(cpu=not cuda, mixed_precision=mixed_precision, fsdp_plugin=plugin)
    if not cuda:
        enable_fsdp_on_cpu(acc, plugin)
    if not acc.is_fsdp2:
        raise RuntimeError(f"trainer.strategy=fsdp2 but accelerate chose {acc.distributed_type}")
    return acc


def enable_fsdp_on_cpu(acc, plugin) -> None:
    """Switch a MULTI_CPU accelerate state to FSDP, as `AcceleratorState.__init__` does for GPU groups.

    The state is shared by every Accelerator/AcceleratorState/PartialState of the process, so the
    Accelerator's `prepare`, `clip_grad_norm_`, `get_state_dict`, `save_state` and `load_state` all
    take their FSDP2 branches from here on.
    """
    from accelerate.state import PartialState
    from accelerate.utils import DistributedType

    state = acc.state
    if state.distributed_type not in (
        DistributedType.MULTI_CPU,
        DistributedType.FSDP,
    ):  # FSDP: a 2nd Accelerator
        raise RuntimeError(f"FSDP2 on CPU expects accelerate's MULTI_CPU state, got {state.distributed_type}")
    if state.mixed_precision != "no":
        plugin.set_mixed_precision(state.mixed_precision)
    state.fsdp_plugin = plugin
    state.distributed_type = DistributedType.FSDP
    PartialState._shared_state["distributed_type"] = DistributedType.FSDP


def plain(x):
    """A DTensor (e.g. the grad norm of FSDP2-sharded grads) as its full value; other tensors unchanged."""
    from torch.distributed.tensor import DTensor

    return x.full_tensor() if isinstance(x, DTensor) else x


def check_config(cfg) -> None:
    """`model.dtype`, `trainer.device`, `trainer.strategy` (raises ConfigError)."""

    m, t = cfg.model, cfg.trainer
    if m.dtype == "float16":
        raise ConfigError(
            "model.dtype='float16' is not supported (fp16 training needs loss scaling, which the learner "
            f"does not do): use one of {list(DTYPES)}"
        )
    choice("model.dtype", m.dtype, DTYPES)
    if m.compute_dtype is not None:
        choice("model.compute_dtype", m.compute_dtype, DTYPES)
    choice("trainer.device", t.device, DEVICES)
    choice("trainer.strategy", t.strategy, STRATEGIES)
    if t.device != "cpu" and not torch.cuda.is_available():
        check_driver()
    if t.device == "cuda" and not torch.cuda.is_available():
        raise ConfigError(
            "trainer.device='cuda' but no CUDA device is visible: use trainer.device=cpu or auto"
        )


def nvidia_gpus() -> tuple[list[str], str | None]:
    """(the NVIDIA GPUs the driver lists, its version), from `nvidia-smi` (installed with the driver); ([], None)
    where it is missing or fails."""
    import shutil
    import subprocess

    if shutil.which("nvidia-smi") is None:
        return [], None
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=name,driver_version", "--format=csv,noheader"],
            capture_output=True, text=True, timeout=20, check=True,
        ).stdout  # fmt: skip
    except (OSError, subprocess.SubprocessError):
        return [], None
    rows = [line.rsplit(",", 1) for line in out.splitlines() if "," in line]
    return [name.strip() for name, _ in rows], (rows[0][1].strip() if rows else None)


def check_driver() -> None:
    """Refuse (ConfigError) a machine whose driver lists NVIDIA GPUs that this torch cannot use: a CUDA build of
    torch on a driver older than its CUDA version reports no GPU (`torch.cuda.is_available()` is False), so the
    learner would run on the CPU while vLLM, which finds the GPUs through NVML, dies at CUDA initialisation
    after loading the model. Called when torch sees no GPU and trainer.device is not cpu."""
    names, driver = nvidia_gpus()
    if not names:
        return
    built = f"torch {torch.__version__}, built for CUDA {torch.version.cuda}" if torch.version.cuda else (
        f"torch {torch.__version__}, a CPU-only build"
    )  # fmt: skip
    raise ConfigError(
        f"{len(names)} NVIDIA GPU(s) ({names[0]}) are listed by the driver (version {driver}), but {built} sees "
        "none (torch.cuda.is_available() is False): the driver is older than this torch's CUDA version, or torch "
        "is a CPU build. Install a driver for CUDA 13.0 (580 or newer: the CUDA wheels of torch 2.13 and vLLM "
        "0.32 need it), or torch and vLLM builds for your driver's CUDA version (nvidia-smi's header names it); "
        "or run on the CPU with trainer.device=cpu"
    )
