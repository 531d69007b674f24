"""The learner: strategy (accelerate: FSDP2 / DDP / none), batching (micro-batches, packing), log-probs
(chunked head), loss assembly, optimizer step, LoRA, the distillation teacher and checkpoint I/O; learner.py is the facade.
It takes per-token tensors and knows no groups or rewards: a step's scoring, advantages and rollout correction,
from a scored batch to the TrainBatch, are rlkit/learn.py's.

It never imports rlkit.rollout: rollouts arrive as `rlkit.batch` batches and the weights leave as an
`rlkit.weights.Export`.
"""

from rlkit.learner import compiled, lora, optim, routing, strategy, teacher
from rlkit.learner.learner import Learner, check_frozen_parts
from rlkit.learner.logprobs import LogProbs

__all__ = ["Learner", "LogProbs", "check_config"]


def check_config(cfg) -> None:
    """The keys the learner owns (model.dtype, trainer.device / strategy / lr_schedule / compile_backend, model.lora.*, the
    distillation teacher, model.freeze_language)."""

    strategy.check_config(cfg)
    optim.check_config(cfg)
    lora.check_config(cfg)
    teacher.check_config(cfg)
    compiled.check_config(cfg)
    routing.check_config(cfg)
    check_frozen_parts(cfg)
