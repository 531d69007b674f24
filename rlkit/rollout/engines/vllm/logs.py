"""Quiet weight pushes and a quiet start: vLLM's routine log lines, folded into one rlkit line at debug level.

Each push (vLLM 0.32's layerwise reload, driven by vllm.reload.worker_reload) logs "Successfully reset prefix
cache" (INFO) and a WARNING "RotaryEmbedding: Failed to load weights" for the rotary layer, which holds no
weights a checkpoint could bring (vLLM keeps its cached cos/sin table): a user would see it every step and
cannot act on it. (A real layer's "Failed to load weights" is also a WeightSyncError naming it.) Inside `quiet_push_logs()` those records are
kept from vLLM's handlers and returned, so the engine logs them as one rlkit debug line; every other warning
and every error of those loggers (e.g. "Following weights were not loaded") still reaches the user.
`quiet_build_logs()` does the same for the notices vLLM logs while it imports and builds its engine that are
about a choice rlkit made (eager mode, no chunked prefill, the dtype) or a CPU-build fact the user cannot act
on. No vllm import: these are logger names.
"""

from __future__ import annotations

import contextlib
import logging
import os
import warnings

# The loggers a push writes to (vLLM 0.32 module names).
PUSH_LOGGERS = (
    "vllm.model_executor.model_loader.reload.inplace",
    "vllm.model_executor.model_loader.reload.layerwise",
    "vllm.v1.core.block_pool",
)
# WARNING records known to be benign during a push: (logger, message format, predicate on the args).
BENIGN_WARNINGS = (
    (
        "vllm.model_executor.model_loader.reload.layerwise",
        "%s: Failed to load weights",
        lambda args: bool(args) and str(args[0]).endswith("RotaryEmbedding"),
    ),
)


class _PushFilter(logging.Filter):
    def __init__(self):
        super().__init__()
        self.quieted: list[str] = []

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno >= logging.ERROR:
            return True
        if record.levelno >= logging.WARNING and not any(
            record.name == name and record.msg == fmt and benign(record.args or ())
            for name, fmt, benign in BENIGN_WARNINGS
        ):
            return True
        self.quieted.append(record.getMessage())
        return False


@contextlib.contextmanager
def _filtered(names, f: logging.Filter):
    """Inside the block, the loggers `names` pass their records through `f` first."""
    loggers = [logging.getLogger(name) for name in names]
    for lg in loggers:
        lg.addFilter(f)
    try:
        yield
    finally:
        for lg in loggers:
            lg.removeFilter(f)


@contextlib.contextmanager
def quiet_push_logs():
    """Inside the block, vLLM's routine push records are kept back; yields the list of their messages."""
    f = _PushFilter()
    with _filtered(PUSH_LOGGERS, f):
        yield f.quieted


# Notices vLLM 0.32 logs while it starts (the import, the engine's build, the first load of the weights) that
# are about a choice rlkit made on the user's behalf, or a CPU-build fact the user cannot act on; a first run
# printed 13 (148 with a bf16 engine) before its progress bar. (logger, message start, why it is expected.)
BUILD_NOTICES = (
    ("vllm.triton_utils.importing", "Triton is installed, but doesn't include CPU backend",
     "the CPU build runs without Triton"),
    ("vllm.platforms.cpu", "Triton is not installed", "the CPU build runs without Triton"),
    # On a CPU with AVX512-BF16 (or AMX) vLLM resets the SSM-state cache dtype for every model, and names the
    # backend 'none' when the model has no SSM state at all; a model that has one still gets its notice.
    ("vllm.platforms.cpu", "Reset SSM cache type to float32 for accelerated GDN mamba backend 'none'",
     "the model has no SSM state (vLLM's AVX512-BF16 CPU check)"),
    ("vllm.config.vllm", "Model Runner V2 requires Triton", "rlkit's build line names the runner"),
    ("vllm.config.vllm", "Enforce eager set", "rlkit runs the CPU engine eagerly (enforce_eager)"),
    ("vllm.config.vllm", "Inductor compilation was disabled", "rlkit runs the CPU engine eagerly"),
    ("vllm.engine.arg_utils", "This model does not officially support disabling chunked prefill",
     "rlkit turns chunked prefill off on CPU (seeded requests: VLLMEngine)"),
    ("vllm.v1.worker.cpu_worker", "CPU backend doesn't allow to use `torch.set_num_threads`",
     "rlkit puts torch.set_num_threads back after the build"),
    ("vllm.v1.worker.cpu_worker", "libtcmalloc is not found in LD_PRELOAD", "a speed hint for the CPU build"),
    ("vllm.v1.worker.cpu_worker", "libiomp is not found in LD_PRELOAD", "a speed hint for the CPU build"),
    ("vllm.model_executor.models.utils", "Attempted to load weight",
     "the checkpoint's dtype cast to model.dtype, which rlkit chose"),
    # A second engine in one process (rlkit.eval after training, a notebook, a test suite) meets the variables
    # the first one set: vLLM's own VLLM_DIST_IDENT (any other unknown VLLM_* variable is still warned
    # about), and V1 multiprocessing off, which external_launcher needs.
    ("vllm.platforms.interface", "Unknown vLLM environment variable detected: VLLM_DIST_IDENT",
     "vLLM's CPU worker set it for an earlier engine of this process"),
    ("vllm.engine.arg_utils", "The global random seed is set to",
     "rlkit restores every random state after the build (contained_side_effects)"),
)  # fmt: skip


class _BuildFilter(logging.Filter):
    def __init__(self):
        super().__init__()
        self.quieted: dict[str, int] = {}

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno >= logging.ERROR:
            return True
        message = record.getMessage()
        for name, start, why in BUILD_NOTICES:
            if record.name == name and message.startswith(start):
                self.quieted[why] = self.quieted.get(why, 0) + 1
                return False
        return True


@contextlib.contextmanager
def quiet_build_logs():
    """Inside the block (or the call, as a decorator), vLLM's expected start-up notices (`BUILD_NOTICES`) are
    kept back, and so are the deprecation warnings of vLLM's own modules (vLLM 0.32's import calls torch APIs
    that torch 2.13 deprecates: nothing a user can act on); yields {why: count}. Every other warning and every
    error still reaches the user. (One notice stays: the CPU worker's "NUMA binding" line, which torch's C++
    logger writes to stderr itself, out of reach of Python's logging.)"""
    # vLLM's INFO lines (its configuration, each load and cache size: ~20 a build) are for debugging vLLM:
    # WARNING and up unless the user set VLLM_LOGGING_LEVEL (read once, at vLLM's first import).
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    f = _BuildFilter()
    with _filtered({n for n, _, _ in BUILD_NOTICES}, f), warnings.catch_warnings():
        for category in (FutureWarning, DeprecationWarning):
            warnings.filterwarnings("ignore", category=category, module=r"vllm(\.|$)")
        yield f.quieted
