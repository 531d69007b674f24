"""On-policy distillation's teacher: its keys, the tokenizer check and the dtype it is loaded in.

The teacher is a second frozen model, loaded once by the learner when `algo.distill_coef > 0` and prepared
like the reference model (sharded under FSDP2, a full copy per rank otherwise; with LoRA it stays a separate
model, since the adapters-off policy is the reference, not a teacher). It scores the policy's sampled tokens in
the log-prob phase (`timing/teacher_s`); the math is rlkit/algos/distill.py.

Distillation compares log-probs token by token, so the teacher must tokenize exactly as the policy does:
`check_config` loads both tokenizers (never a model) and refuses a difference, naming both models.
Cross-tokenizer distillation is out of scope.

Everything else that would stop a run later is checked at start-up too, each refusal naming
`algo.teacher.path`: `check_config` reads the teacher's `config.json` (no weights) for an architecture
`AutoModelForCausalLM` can build and a vocabulary that covers every token the policy can sample, and refuses
weights stored only as pickles (`pytorch_model.bin`: unpickling can run code, so rlkit loads safetensors
only); `load` checks the loaded parameters finite. A teacher with finite weights whose log-probs still
overflow is named by the `NonFiniteError` that stops the run (rlkit/learner/optim.py).
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch

from rlkit.config.rules import choice, model_folder_ok
from rlkit.config.schema import ConfigError
from rlkit.models import load_causal_lm, load_tokenizer, resolve_model

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
    _check_model(path, cfg.model.path, len(student))


def _config(path: str):
    """The `config.json` of model `path` (no weights; never remote code) and its directory (None for a GGUF
    file)."""
    from transformers import AutoConfig

    directory, gguf_file = resolve_model(path)
    kwargs = {"gguf_file": gguf_file} if gguf_file else {}
    return AutoConfig.from_pretrained(directory, trust_remote_code=False, **kwargs), (
        None if gguf_file else directory
    )


def _vocab_size(config) -> int | None:
    return getattr(config.get_text_config(), "vocab_size", None)


def _check_model(path: str, policy_path: str, tokenizer_size: int) -> None:
    """The teacher's config and weight files, before any model loads (raises ConfigError)."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

    model_folder_ok("algo.teacher.path", path)
    try:
        config, directory = _config(path)
    except (OSError, ValueError, KeyError) as e:
        raise ConfigError(f"algo.teacher.path={path!r}: its config.json does not load ({e})") from e
    if type(config) not in MODEL_FOR_CAUSAL_LM_MAPPING:
        raise ConfigError(
            f"algo.teacher.path={path!r}: its architecture (model_type {config.model_type!r}, "
            f"{config.architectures}) is not one AutoModelForCausalLM can load; a teacher is a causal LM"
        )
    vocab = _vocab_size(config)
    try:
        policy_vocab = _vocab_size(_config(policy_path)[0])
    except (OSError, ValueError, KeyError):
        policy_vocab = None  # the learner's own load reports it
    # The teacher scores every token the policy samples: ids up to the policy's (possibly padded) vocabulary.
    need = max(tokenizer_size, policy_vocab or 0)
    if vocab is not None and vocab < need:
        raise ConfigError(
            f"algo.teacher.path={path!r} has vocab_size={vocab}, fewer than the {need} token ids the policy "
            f"can sample (tokenizer: {tokenizer_size}, model.path={policy_path!r}: vocab_size={policy_vocab}): "
            "the teacher could not score them. Use a teacher of the same model family"
        )
    if directory is not None and Path(directory).is_dir():
        files = [p.name for p in Path(directory).iterdir()]
        if not any(f.endswith(".safetensors") for f in files):
            pickled = sorted(f for f in files if f.endswith((".bin", ".pt", ".pth", ".ckpt")))
            raise ConfigError(
                f"algo.teacher.path={path!r} holds no *.safetensors weights"
                + (f", only pickled ones ({', '.join(pickled[:3])})" if pickled else "")
                + ": rlkit loads a teacher from safetensors only (unpickling a file can run code). Convert it "
                "once where you trust the file: AutoModelForCausalLM.from_pretrained(path).save_pretrained(path)"
            )


def load(cfg, compute_dtype: torch.dtype) -> torch.nn.Module:
    """The teacher of `algo.teacher.path`, on the CPU in its dtype, refused (ConfigError naming the key) when a
    parameter holds NaN or inf: every step would be skipped as non-finite, blaming the learning rate."""
    path = cfg.algo.teacher.path
    model = load_causal_lm(path, dtype=torch_dtype(cfg, compute_dtype), device="cpu")
    bad = [n for n, p in model.named_parameters() if not bool(torch.isfinite(p).all())]
    if bad:
        raise ConfigError(
            f"algo.teacher.path={path!r}: {len(bad)} parameter tensors of the teacher hold NaN or inf "
            f"({', '.join(bad[:3])}{', ...' if len(bad) > 3 else ''}); its log-probs would not be finite. "
            "Use a teacher with finite weights (a checkpoint written before a run diverged)"
        )
    return model
