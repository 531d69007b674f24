"""The rollout half of training as the trainer sees it: one protocol, two implementations.

`LocalRollouts` (rlkit/rollout/local.py) runs the engine in the trainer's process (trainer.mode=sync, one per
training rank); `AsyncRollouts` (rlkit/rollout/remote/client.py) drives rollout worker processes that each run
a `LocalRollouts` (trainer.mode=async). The trainer and `rlkit.sync.WeightSync` call only what is here.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

from rlkit.batch import ScoredBatch
from rlkit.timing import Timers
from rlkit.weights import Export


@runtime_checkable
class Rollouts(Protocol):
    """Prompts in, scored batches out; the learner's weights in after every update."""

    engine_name: str
    """The engine as the user chose it, for messages ("vllm", "hf, in 2 rollout worker process(es)")."""
    last_eval: list
    """The prompts of the last evaluation (rlkit.rollout.evaluation.PromptResult; async: empty, the workers
    keep their samples)."""

    def start(self, export: Export, step: int, *, evaluate: bool = False) -> None:
        """The run begins (or resumes) at `step`: the engine gets the learner's weights of `step` (at step 0 it
        has them from the checkpoint and they are verified); `evaluate`: an eval of `step` will be asked."""
        ...

    def produce(self, step: int, timers: Timers) -> ScoredBatch:
        """Phases 1-2 (generate, environment turns, rewards, filter / refill): this rank's share of the batch
        trained at `step`, each phase timed in `timers`."""
        ...

    def push(self, export: Export, version: int, *, evaluate: bool = False) -> dict[str, float]:
        """The learner's weights of `version` reach the engine and are verified (rollout.verify_push); returns
        the push's statistics (rlkit.weights.push_weights). `evaluate`: `evaluate(version)` will be called
        (async workers must evaluate a version before they load the next one)."""
        ...

    def evaluate(self, version: int) -> dict[str, float]:
        """The `eval/*` metrics of the engine's weights `version` on the held-out split (never masked)."""
        ...

    def checkpoint(self, directory) -> dict:
        """Save what the rollout side must resume from (the data position; async: the batches not yet
        trained, into `directory`); returns what the checkpoint's state records for it."""
        ...

    def load_checkpoint(self, directory, state: dict) -> None:
        """Resume from what `checkpoint` wrote."""
        ...

    def close(self) -> None:
        """Stop the engine and the workers (reward workers; async: the rollout worker processes)."""
        ...
