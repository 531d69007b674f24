"""Quiet weight pushes: vLLM's per-push log lines, folded into one rlkit line at debug level.

Each push (vLLM 0.32's layerwise reload, driven by vllm_reload.worker_reload) logs "Successfully reset prefix
cache" (INFO) and a WARNING "RotaryEmbedding: Failed to load weights" for the rotary layer, which holds no
weights a checkpoint could bring (vLLM keeps its cached cos/sin table): a user would see it every step and
cannot act on it. (A real layer's "Failed to load weights" is also a WeightSyncError naming it.) Inside `quiet_push_logs()` those records are
kept from vLLM's handlers and returned, so the engine logs them as one rlkit debug line; every other warning
and every error of those loggers (e.g. "Following weights were not loaded") still reaches the user.
No vllm import: these are logger names.
"""

from __future__ import annotations

import contextlib
import logging

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
def quiet_push_logs():
    """Inside the block, vLLM's routine push records are kept back; yields the list of their messages."""
    f = _PushFilter()
    loggers = [logging.getLogger(name) for name in PUSH_LOGGERS]
    for lg in loggers:
        lg.addFilter(f)
    try:
        yield f.quieted
    finally:
        for lg in loggers:
            lg.removeFilter(f)
