"""`trainer.compile`: the policy's forward through `torch.compile` (inductor: C++ on CPU, Triton on CUDA).

The model is compiled in place (`nn.Module.compile`) with dynamic shapes from the first call, so the
varying widths of padded micro-batches and the varying lengths of packed ones reuse one graph instead of
recompiling at every new length: a whole run compiles a bounded number of graphs (measured with 6 widths:
2 graphs, forward and backward, then none). `learner/compiled_graphs` counts the graphs compiled so far in
the process (torch._dynamo's counter), so a recompile storm shows in the metrics. The chunked LM head
(rlkit/learner/logprobs.py) stays eager: its chunk loop is a custom autograd function whose memory saving
is the point. Off by default: compilation costs minutes on CPU, and it pays only where it is measured
faster over a whole run including the compilation (docs/benchmarks.md).
"""

from __future__ import annotations

import torch

from rlkit.config.rules import choice

BACKENDS = ("inductor", "aot_eager", "eager")  # trainer.compile_backend


def compile_policy(model: torch.nn.Module, backend: str) -> None:
    """Compile `model`'s forward in place with dynamic shapes."""
    model.compile(backend=backend, dynamic=True)


def compiled_graphs() -> int:
    """Graphs torch.compile has compiled in this process so far (first compiles and recompiles)."""
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])


def check_config(cfg) -> None:
    """`trainer.compile_backend` (raises ConfigError)."""
    choice("trainer.compile_backend", cfg.trainer.compile_backend, BACKENDS)
