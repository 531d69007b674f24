"""On-policy distillation's teacher: its keys, the tokenizer check and the dtype it is loaded in.

The teacher is a second frozen model, loaded once by the learner when `algo.distill_coef > 0` and prepared
like the reference model (sharded under FSDP2, a full copy per rank otherwise; with LoRA it stays a separate
model, since the adapters-off policy is the reference, not a teacher). It scores the policy's sampled tokens in
the log-prob phase (`timing/teacher_s`); the math is rlkit/algos/distill.py.

Distillation compares log-probs token by token, so the teacher must tokenize exactly as the policy does:
`check_config` loads both tokenizers (never a model) and refuses a difference, naming both models.
Cross-tokenizer distillation is out of scope.
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch

from rlkit.config.rules import choice
from rlkit.config.schema import ConfigError
from rlkit.models import load_tokenizer

log = logging.getLogger(__name__)

DTYPES = ("auto", "float32", "bfloat16")  # algo.teacher.dtype


def enabled(cfg) -> bool:
    """Whether the run distills from a teacher (and so loads one)."""
    return cfg.algo.distill_coef > 0


def torch_dtype(cfg, compute_dtype: torch.dtype) -> torch.dtype:
    """The teacher's dtype: `algo.teacher.dtype`, or the learner's compute dtype for auto."""
    name = cfg.algo.teacher.dtype
    return compute_dtype if name == "auto" else getattr(torch, name)


def _tokenizer_difference(student, teacher) -> str | None:
    """A short description of how two tokenizers differ, or None when they tokenize alike."""
    if len(student) != len(teacher):
        return f"{len(student)} vs {len(teacher)} tokens"
    sv, tv = student.get_vocab(), teacher.get_vocab()
    if sv != tv:
        diff = sorted(set(sv.items()) ^ set(tv.items()))[:3]
        return f"different vocabularies (e.g. {diff})"
    for name in ("bos_token_id", "eos_token_id"):
        if getattr(student, name) != getattr(teacher, name):
            return f"{name} {getattr(student, name)} vs {getattr(teacher, name)}"
    return None


def check_config(cfg) -> None:
    """`algo.teacher.*` and `algo.distill_coef` / `task_coef` (raises ConfigError): a teacher path when
    distilling, its dtype, and a tokenizer equal to the policy's (both tokenizers load; no model does)."""
    a = cfg.algo
    choice("algo.teacher.dtype", a.teacher.dtype, DTYPES)
    if not enabled(cfg):
        if a.teacher.path:
            log.warning("algo.teacher.path is set but algo.distill_coef=0: the teacher is not loaded")
        if a.task_coef not in (0, 1):
            log.warning(
                "algo.task_coef=%g has no effect without distillation (algo.distill_coef=0)", a.task_coef
            )
        if a.task_coef == 0:
            raise ConfigError(
                "algo.task_coef=0 and algo.distill_coef=0: nothing to learn from; set algo.distill_coef > 0 "
                "(with algo.teacher.path) or algo.task_coef > 0"
            )
        return
    path = a.teacher.path
    if not path:
        raise ConfigError(
            f"algo.distill_coef={a.distill_coef} > 0 needs algo.teacher.path (a hub id, a local model directory, "
            "smollm2-135m or a checkpoint's model/ directory)"
        )
    if path.startswith(("/", ".", "~")) and not Path(path).expanduser().exists():
        raise ConfigError(
            f"algo.teacher.path={path!r} does not exist (a local path). +recipe=distill_quickstart's teacher is "
            "written by `make distill-teacher`"
        )
    if a.task_coef > 0 and cfg.reward.fn == "none":
        log.warning("reward.fn=none: the task advantage is 0; algo.task_coef has no effect")
    try:
        student, teacher = load_tokenizer(cfg.model.path), load_tokenizer(path)
    except (OSError, ValueError) as e:
        raise ConfigError(f"algo.teacher.path={path!r}: its tokenizer does not load ({e})") from e
    why = _tokenizer_difference(student, teacher)
    if why is not None:
        raise ConfigError(
            f"algo.teacher.path={path!r} and model.path={cfg.model.path!r} have different tokenizers ({why}): "
            "on-policy distillation compares the two models' log-probs token by token and needs the same "
            "tokenizer (cross-tokenizer distillation is not supported)"
        )
