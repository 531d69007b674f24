"""The rollout-engine protocol shared by the HF and vLLM engines."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

from torch import Tensor

from rlkit.batch import RolloutBatch


@dataclass(frozen=True)
class Sampling:
    """How to sample. The same object drives both engines."""

    temperature: float = 1.0
    """Softmax temperature; 0 means greedy."""
    top_p: float = 1.0
    """Nucleus sampling mass (1.0 = off)."""
    top_k: int = 0
    """Keep the k most likely tokens (0 = off)."""
    max_new_tokens: int = 256
    """Generation stops after this many tokens (finish reason "length")."""
    stop: tuple[str, ...] = ()
    """Extra stop strings besides EOS (finish reason "stop"); the stop string is kept in the response."""
    seed: int | None = None
    """Seed for this call; None = the engine's running generator."""

    def __post_init__(self):
        if self.temperature < 0:
            raise ValueError(f"sampling.temperature={self.temperature} must be >= 0")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"sampling.top_p={self.top_p} must be in (0, 1]")
        if self.top_k < 0:
            raise ValueError(f"sampling.top_k={self.top_k} must be >= 0 (0 = off)")
        if self.max_new_tokens < 1:
            raise ValueError(f"sampling.max_new_tokens={self.max_new_tokens} must be >= 1")


@runtime_checkable
class RolloutEngine(Protocol):
    """Turns tokenised prompts into groups of sampled completions with per-token log-probs."""

    name: str

    def generate(self, prompts: list[list[int]], n: int, sampling: Sampling) -> RolloutBatch:
        """Sample `n` completions per prompt; rows of a prompt are contiguous (group index = prompt index)."""
        ...

    def load_weights(self, named_tensors: Iterable[tuple[str, Tensor]]) -> None:
        """Replace the engine's weights in place with the learner's (HF/transformers parameter names)."""
        ...

    def sleep(self) -> None:
        """Free KV cache / weights memory while the learner trains (no-op where unsupported)."""
        ...

    def wake(self) -> None:
        """Undo `sleep`."""
        ...

    def close(self) -> None: ...
