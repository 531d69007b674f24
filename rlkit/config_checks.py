"""Start-up checks of a configuration beyond choices: unknown keys, the range of every number, and the
rules that tie keys together. `rlkit.config.load_config` / `validate` call them before any model loads;
every error is a `ConfigError` in the user's key names (never an internal `learner.*` name).

`RANGES` holds the valid range of every numeric key of `RLConfig` (a test holds it complete), so a new
number cannot be added without saying which values work.
"""

from __future__ import annotations

import dataclasses as dc
import difflib
import math
import typing
from dataclasses import dataclass
from pathlib import Path

from rlkit.config import VALID_ARITHMETIC_KINDS, ConfigError, RLConfig


@dataclass(frozen=True)
class Range:
    """lo <(=) value <(=) hi; None = unbounded. NaN is never in range; inf only with `allow_inf`."""

    lo: float | None = None
    hi: float | None = None
    lo_open: bool = False
    hi_open: bool = False
    allow_inf: bool = False

    def __contains__(self, v) -> bool:
        if isinstance(v, float) and (math.isnan(v) or (math.isinf(v) and not self.allow_inf)):
            return False
        if self.lo is not None and not (v > self.lo if self.lo_open else v >= self.lo):
            return False
        return self.hi is None or (v < self.hi if self.hi_open else v <= self.hi)

    def __str__(self) -> str:
        if self.lo is not None and self.hi is not None:
            return f"in {'(' if self.lo_open else '['}{self.lo:g}, {self.hi:g}{')' if self.hi_open else ']'}"
        if self.lo is not None:
            return f"{'>' if self.lo_open else '>='} {self.lo:g}" + (" (or inf)" if self.allow_inf else "")
        return "a finite number"


def _ge(lo, **kw) -> Range:
    return Range(lo=lo, **kw)


def _gt(lo, **kw) -> Range:
    return Range(lo=lo, lo_open=True, **kw)


ANY_FINITE = Range()
UNIT = Range(0, 1)  # [0, 1]

# The valid values of every int / float key (Optional keys: when not null).
RANGES: dict[str, Range] = {
    "data.eval_size": _ge(0),
    "model.lora.rank": _ge(0),
    "model.lora.alpha": _gt(0),
    "model.lora.dropout": Range(0, 1, hi_open=True),
    "data.max_prompt_tokens": _ge(1),
    "data.num_train": _ge(1),
    "data.num_eval": _ge(1),
    "rollout.group_size": _ge(1),
    "rollout.temperature": _gt(0),
    "rollout.top_p": Range(0, 1, lo_open=True),
    "rollout.top_k": _ge(0),
    "rollout.max_new_tokens": _ge(1),
    "rollout.mismatch_samples": _ge(0),
    "rollout.weight_sync_kl_threshold": _gt(0),
    "rollout.eval_group_size": _ge(1),
    "rollout.eval_temperature": _ge(0),
    # A threshold below 1 would cap or mask the on-policy ratio 1 itself.
    "algo.rollout_is.upper": _ge(1),
    "algo.rollout_is.lower": UNIT,
    "algo.rollout_is.veto_lower": Range(0, 1, lo_open=True, hi_open=True),
    "algo.rollout_is.veto_upper": _gt(1),
    "algo.clip_low": UNIT,  # the ratio's lower bound 1 - clip_low stays >= 0
    "algo.clip_high": _ge(0),
    "algo.dual_clip": _gt(1),
    "algo.norm_len": _ge(1),
    "algo.kl_coef": _ge(0),
    "algo.entropy_coef": _ge(0),
    "algo.gamma": UNIT,
    "algo.lam": UNIT,
    "algo.vf_coef": _ge(0),
    "algo.value_clip": _gt(0),
    "algo.ppo_epochs": _ge(1),
    "algo.mini_batches": _ge(1),
    "algo.rollout_kl_coef": _ge(0),
    "algo.max_gen_batches": _ge(1),
    "reward.timeout_s": _gt(0),
    "reward.num_workers": _ge(1),
    "reward.model_weight": ANY_FINITE,
    "reward.model_batch_size": _ge(1),
    "reward.batch_timeout_s": _gt(0),
    "reward.overlong_buffer": _ge(0),
    "reward.overlong_penalty": _ge(0),
    "trainer.steps": _ge(1),
    "trainer.train_batch_size": _ge(1),
    "trainer.lr": _ge(0),
    "trainer.weight_decay": _ge(0),
    "trainer.warmup_steps": _ge(0),
    # 0 zeroes every update and a negative norm flips its sign (torch scales by max_norm / norm).
    "trainer.max_grad_norm": _gt(0, allow_inf=True),
    "trainer.max_tokens_per_microbatch": _ge(1),
    "trainer.seed": Range(0, 2**63, hi_open=True),  # numpy's seed sequence refuses negative seeds
    "trainer.eval_every": _ge(0),
    "trainer.save_every": _ge(0),
    "trainer.keep_last": _ge(0),
    "trainer.num_processes": _ge(1),
    "trainer.collective_timeout_s": _gt(0),
    "trainer.logprob_chunk_tokens": _ge(0),  # 0 = full logits
    "trainer.max_staleness": _ge(0),
    "trainer.rollout_gpus": _ge(1),
    "env.max_turns": _ge(1),
    "env.max_total_tokens": _ge(1),
    "env.timeout_s": _gt(0),
}


def _hints(cls) -> dict[str, object]:
    return typing.get_type_hints(cls)


def schema_fields(cls=RLConfig, prefix: str = "") -> dict[str, object]:
    """{dotted key: type} of every leaf key of the schema."""
    out = {}
    for name, tp in _hints(cls).items():
        if dc.is_dataclass(tp):
            out.update(schema_fields(tp, f"{prefix}{name}."))
        else:
            out[f"{prefix}{name}"] = tp
    return out


def numeric_keys() -> list[str]:
    """Every int / float (or Optional int / float) key of the schema."""
    out = []
    for key, tp in schema_fields().items():
        if typing.get_origin(tp) is typing.Union:
            tp = next(a for a in typing.get_args(tp) if a is not type(None))
        if tp in (int, float):
            out.append(key)
    return out


def check_unknown_keys(node, cls=RLConfig, prefix: str = "") -> None:
    """Raise for a key the schema does not have (e.g. `+trainer.stepz=3`), suggesting close ones."""
    hints = _hints(cls)
    for key in list(node.keys()):
        full = f"{prefix}{key}"
        if key not in hints:
            valid = sorted(f"{prefix}{k}" for k in hints)
            close = difflib.get_close_matches(full, valid, n=3, cutoff=0.75)
            hint = f"did you mean {' or '.join(close)}?" if close else f"valid keys here: {valid}"
            raise ConfigError(f"{full} is not a config key: {hint}")
        if dc.is_dataclass(hints[key]) and hasattr(node[key], "keys"):
            check_unknown_keys(node[key], hints[key], full + ".")


def _get(cfg: RLConfig, key: str):
    for part in key.split("."):
        cfg = getattr(cfg, part)
    return cfg


def check_ranges(cfg: RLConfig) -> None:
    for key, valid in RANGES.items():
        value = _get(cfg, key)
        if value is not None and value not in valid:
            raise ConfigError(f"{key}={value!r} must be {valid}")


def _nonempty(key: str, value) -> None:
    if not isinstance(value, str) or not value.strip():
        raise ConfigError(f"{key}={value!r} must be a non-empty string")


def _engine_kwargs(cfg: RLConfig) -> None:
    """The HF engine takes few keywords: a wrong one would only raise after the learner loaded."""
    import inspect

    engine = cfg.rollout.engine
    if engine == "auto":
        from rlkit.rollout import vllm_usable

        engine = "vllm" if vllm_usable()[0] else "hf"
    if engine != "hf" or not cfg.rollout.engine_kwargs:
        return  # vLLM passes unknown keywords on to vllm.LLM
    from rlkit.rollout.hf import HFEngine

    params = inspect.signature(HFEngine.__init__).parameters
    valid = sorted(
        k for k, p in params.items() if p.kind is p.KEYWORD_ONLY and k not in ("dtype", "device", "seed")
    )
    for k in cfg.rollout.engine_kwargs:
        if k not in valid:
            raise ConfigError(f"rollout.engine_kwargs.{k} is not a keyword of the hf engine: valid {valid}")
    mbs = cfg.rollout.engine_kwargs.get("max_batch_size", 1)
    if not isinstance(mbs, int) or mbs < 1:
        raise ConfigError(f"rollout.engine_kwargs.max_batch_size={mbs!r} must be an integer >= 1")


def _device(cfg: RLConfig) -> None:
    import torch

    t = cfg.trainer
    if t.device == "cuda" and not torch.cuda.is_available():
        raise ConfigError(
            "trainer.device='cuda' but no CUDA device is visible: use trainer.device=cpu or auto"
        )


# Distinct problems of each generated arithmetic kind (rlkit.data._arithmetic_problem: a, b in 1..20,
# 6 names x 5 things in the stories; a subtraction story orders a >= b; plain_mul: a, b in 100..999;
# plain_add2: a, b in 10..99; plain_add3: c in 1..20; story_two_step: c in 1..a+b).
ARITHMETIC_SIZES = {
    "plain_add": 20 * 20,
    "story_add": 20 * 20 * 30,
    "story_sub": 210 * 30,
    "plain_mul": 900 * 900,
    "plain_add2": 90 * 90,
    "plain_add3": 20 * 20 * 20,
    "story_two_step": sum(a + b for a in range(1, 21) for b in range(1, 21)) * 30,
}
assert set(ARITHMETIC_SIZES) == set(VALID_ARITHMETIC_KINDS)


def _data(cfg: RLConfig) -> None:
    d = cfg.data
    for key in ("train_split", "prompt_key", "answer_key"):
        _nonempty(f"data.{key}", getattr(d, key))
    if d.prompt_key == d.answer_key:
        raise ConfigError(f"data.prompt_key and data.answer_key are both {d.prompt_key!r}: use two columns")
    if d.path == "arithmetic":
        size = sum(ARITHMETIC_SIZES[k] for k in set(d.arithmetic_kinds))
        if d.num_train + d.num_eval > size:
            raise ConfigError(
                f"data.num_train + data.num_eval = {d.num_train + d.num_eval} exceeds the {size} distinct "
                f"problems of data.arithmetic_kinds={list(d.arithmetic_kinds)}"
            )
        return
    from rlkit.data import FILE_TYPES

    local = Path(d.path).expanduser()
    looks_local = d.path.startswith((".", "/", "~")) or local.suffix in FILE_TYPES
    if looks_local and not local.exists():
        raise ConfigError(f"data.path={d.path!r} does not exist")
    if local.is_file() and local.suffix not in FILE_TYPES:
        raise ConfigError(
            f"data.path={d.path!r}: file type {local.suffix!r} is not one of {list(FILE_TYPES)}"
        )


def _rewards(cfg: RLConfig) -> None:
    from rlkit.rewards import resolve

    w = cfg.reward
    _nonempty("reward.fn", w.fn)
    routes = [(f"reward.routes.{k}", v) for k, v in w.routes.items()]
    for key, spec in [("reward.fn", w.fn), *((f"reward.extra.{k}", k) for k in w.extra), *routes]:
        try:
            resolve(spec)
        except ValueError as e:
            raise ConfigError(f"{key}: {e}") from e
    for k, weight in w.extra.items():
        if weight is None or not math.isfinite(weight):
            raise ConfigError(f"reward.extra.{k}={weight!r} must be a finite weight")


def check_rules(cfg: RLConfig) -> None:
    """The rules between keys, and the non-numeric keys `validate` does not check by choice."""
    m, r, a, t, lg = cfg.model, cfg.rollout, cfg.algo, cfg.trainer, cfg.logger
    _nonempty("model.path", m.path)
    for key, path in (("model.path", m.path), ("reward.model", cfg.reward.model)):
        if path and path.startswith(("/", ".", "~")) and not Path(path).expanduser().exists():
            raise ConfigError(f"{key}={path!r} does not exist (a local path: it starts with / . or ~)")
    targets = list(m.lora.target_modules)
    if not targets or not all(isinstance(x, str) and x for x in targets):
        raise ConfigError(
            f"model.lora.target_modules={targets!r} must be a non-empty list of module names, e.g. [q_proj, v_proj]"
        )
    if len(t.betas) != 2 or any(b is None or not 0 <= b < 1 for b in t.betas):
        raise ConfigError(f"trainer.betas={list(t.betas)!r} must be two values in [0, 1), e.g. [0.9, 0.999]")
    optimizer_steps = t.steps * a.ppo_epochs * a.mini_batches
    if t.warmup_steps > optimizer_steps:
        raise ConfigError(
            f"trainer.warmup_steps={t.warmup_steps} exceeds the run's {optimizer_steps} optimizer steps "
            "(trainer.steps x algo.ppo_epochs x algo.mini_batches): the learning rate would never peak"
        )
    if r.eval_group_size > 1 and r.eval_temperature == 0:
        raise ConfigError(
            f"rollout.eval_group_size={r.eval_group_size} with rollout.eval_temperature=0 (greedy) draws "
            "the same sample k times: set rollout.eval_temperature > 0 or rollout.eval_group_size=1"
        )
    if any(not isinstance(s, str) or not s for s in r.stop):
        raise ConfigError(f"rollout.stop={list(r.stop)!r}: a stop string must be non-empty")
    if a.value_model and a.adv_estimator != "gae":
        raise ConfigError(
            f"algo.value_model=true trains a critic that only algo.adv_estimator='gae' uses "
            f"(it is {a.adv_estimator!r}): set algo.value_model=false"
        )
    if a.value_model and a.vf_coef == 0:
        raise ConfigError(
            "algo.vf_coef=0 never trains the critic of algo.value_model=true: use algo.vf_coef > 0"
        )
    _nonempty("trainer.run_dir", t.run_dir)
    if Path(t.run_dir).expanduser().is_file():
        raise ConfigError(f"trainer.run_dir={t.run_dir!r} is a file, not a directory")
    if t.resume not in ("auto", "none") and not Path(t.resume).expanduser().is_dir():
        raise ConfigError(
            f"trainer.resume={t.resume!r} is not 'auto', 'none' or an existing checkpoint directory"
        )
    _nonempty("logger.name", lg.name)
    if lg.backend == "wandb":
        _nonempty("logger.project", lg.project)
        for tag in lg.tags:
            if not isinstance(tag, str) or not 1 <= len(tag) <= 64:
                raise ConfigError(f"logger.tags: {tag!r} must be 1 to 64 characters (a W&B limit)")
    _data(cfg)
    _rewards(cfg)
    _device(cfg)
    _engine_kwargs(cfg)
