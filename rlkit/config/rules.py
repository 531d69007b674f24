"""Start-up checks of a configuration that need only the schema and the math's registries: unknown keys and
wrong types (`parse`), the range of every number (`RANGES`), the names of the algorithm's keys (asked of the
registries in rlkit/algos) and the rules that tie keys together (`validate`).

Each component checks the keys it owns with a `check_config(cfg)` beside its code (data, rewards, envs,
engines, learner, producer, trainer); `rlkit.train.preflight` calls all of them before
any process starts or model loads. Every error is a `ConfigError` naming the key, the value and the valid
choices.

`RANGES` holds the valid range of every numeric key of `RLConfig` (a test holds it complete), so a new
number cannot be added without saying which values work.
"""

from __future__ import annotations

import dataclasses as dc
import difflib
import functools
import logging
import math
import typing
from dataclasses import dataclass
from pathlib import Path

from omegaconf import DictConfig, OmegaConf

from rlkit.algos import advantages, correction, kl, losses
from rlkit.config.derived import derive
from rlkit.config.schema import ConfigError, RLConfig
from rlkit.logging import BACKENDS
from rlkit.model_files import ModelFolderError, check_model_folder

log = logging.getLogger(__name__)


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
    "data.max_image_pixels": _ge(1),
    "data.num_train": _ge(1),
    "data.num_eval": _ge(1),
    "rollout.group_size": _ge(1),
    "rollout.temperature": _gt(0),
    "rollout.top_p": Range(0, 1, lo_open=True),
    "rollout.top_k": _ge(0),
    "rollout.max_new_tokens": _ge(1),
    "rollout.mismatch_samples": _ge(0),
    "rollout.weight_sync_kl_threshold": _gt(0),
    "rollout.accept_engine_gap": _gt(0),
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
    "algo.max_token_staleness": _ge(0),
    "algo.max_gen_batches": _ge(1),
    "algo.distill_coef": _ge(0),
    "algo.distill_gamma": UNIT,
    "algo.task_coef": _ge(0),
    "reward.timeout_s": _gt(0),
    "reward.num_workers": _ge(1),
    "reward.model_weight": ANY_FINITE,
    "reward.model_batch_size": _ge(1),
    "reward.batch_timeout_s": _gt(0),
    "reward.memory_limit_mb": _ge(64),
    "reward.max_processes": _ge(8),
    "reward.max_failed_steps": _ge(0),
    "reward.overlong_buffer": _ge(0),
    "reward.overlong_penalty": _ge(0),
    "reward.correct_threshold": ANY_FINITE,
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
    "trainer.max_nonfinite_steps": _ge(1),
    "trainer.num_processes": _ge(1),
    "trainer.collective_timeout_s": _gt(0),
    "trainer.peak_tflops": _gt(0),
    "trainer.logprob_chunk_tokens": _ge(0),  # 0 = full logits
    "trainer.max_staleness": _ge(0),
    "trainer.rollout_gpus": _ge(1),
    "trainer.log_samples": _ge(0),
    "sft.max_length": _ge(2),
    "sft.epochs": _ge(1),
    "eval.n": _ge(1),
    "eval.temperature": _ge(0),
    "env.max_turns": _ge(1),
    "env.max_total_tokens": _ge(1),
    "env.timeout_s": _gt(0),
    "env.startup_timeout_s": _gt(0),
    "env.memory_limit_mb": _ge(64),
    "env.max_processes": _ge(8),
    "env.max_failed_steps": _ge(0),
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


def nonempty(key: str, value) -> None:
    if not isinstance(value, str) or not value.strip():
        raise ConfigError(f"{key}={value!r} must be a non-empty string")


def choice(key: str, value, choices) -> None:
    if value not in choices:
        raise ConfigError(f"{key}={value!r} is not one of {list(choices)}")


@functools.cache
def _schema() -> DictConfig:
    """`RLConfig`'s structured config, built once per process (~30 ms; `OmegaConf.merge` copies its first
    argument, so the cached one is never changed)."""
    return OmegaConf.structured(RLConfig)


def parse(cfg: DictConfig | dict, *, world_size: int = 1) -> RLConfig:
    """Composed Hydra config -> `RLConfig` checked by this module (unknown keys and wrong types raise here).

    The components' own checks run in `rlkit.train.preflight` (`rlkit.train.load_config` runs both).
    """
    from omegaconf.errors import OmegaConfBaseException

    # Hydra's `+group.key=value` adds a key even to the structured schema; refuse it by name.
    check_unknown_keys(cfg)
    try:
        merged = OmegaConf.merge(_schema(), cfg)
        missing = sorted(OmegaConf.missing_keys(merged))
        if missing:
            raise ConfigError(
                f"missing value for {missing}: set them on the command line (e.g. {missing[0]}=...)"
                + (" - model.path is missing" if "model.path" in missing else "")
            )
        config: RLConfig = OmegaConf.to_object(merged)
    except OmegaConfBaseException as e:  # a wrong type, e.g. trainer.steps=abc
        raise ConfigError(f"{e.full_key}: {str(e.msg).splitlines()[0]}") from e
    validate(config, world_size=world_size)
    return config


def _algo_names(a) -> None:
    """The algorithm's names, asked of the registries that implement them."""
    for key, value, names in (
        ("algo.adv_estimator", a.adv_estimator, advantages.ESTIMATORS),
        ("algo.policy_loss", a.policy_loss, losses.POLICY_LOSSES),
        ("algo.loss_agg_mode", a.loss_agg_mode, losses.AGG_MODES),
        ("algo.kl_estimator", a.kl_estimator, kl.ESTIMATORS),
        ("algo.rollout_kl_estimator", a.rollout_kl_estimator, kl.ESTIMATORS),
        ("algo.rollout_is.level", a.rollout_is.level, correction.LEVELS),
        ("algo.rollout_is.mode", a.rollout_is.mode, correction.MODES),
    ):
        choice(key, value, names)


def _algo_rules(cfg: RLConfig) -> None:
    """Rules between the algorithm's keys; what an estimator needs comes from its registry entry."""
    a, r = cfg.algo, cfg.rollout
    est = advantages.ESTIMATORS.props(a.adv_estimator)
    is_cfg = a.rollout_is
    if is_cfg.lower is not None and is_cfg.lower >= is_cfg.upper:
        raise ConfigError(
            f"algo.rollout_is.lower={is_cfg.lower!r} must be below algo.rollout_is.upper={is_cfg.upper!r}"
        )
    # veto_lower < 1 < veto_upper by their ranges.
    if est["needs_critic"] and not a.value_model:
        raise ConfigError(f"algo.adv_estimator={a.adv_estimator!r} needs a critic: set algo.value_model=true")
    if a.kl_in_reward and not est["token_level"]:
        raise ConfigError(
            f"algo.kl_in_reward=true needs token-level rewards: algo.adv_estimator={a.adv_estimator!r} "
            f"is not one of {advantages.ESTIMATORS.names(token_level=True)}"
        )
    # Eval is never normalised (it reports accuracy), so only the training group size matters.
    if a.norm_by_std and a.adv_estimator == "grpo" and r.group_size < 2:
        raise ConfigError(
            "algo.norm_by_std=true needs rollout.group_size >= 2 (the std of one sample is undefined)"
        )
    if est["group_based"] and r.group_size < 2:
        raise ConfigError(
            f"rollout.group_size={r.group_size} must be >= 2 for algo.adv_estimator={a.adv_estimator!r} "
            "(a group of one has advantage 0 and learns nothing)"
        )
    if a.value_model and not est["needs_critic"]:
        raise ConfigError(
            f"algo.value_model=true trains a critic that algo.adv_estimator={a.adv_estimator!r} does not use "
            f"(the estimators with a critic: {advantages.ESTIMATORS.names(needs_critic=True)}): set "
            "algo.value_model=false"
        )
    if a.value_model and a.vf_coef == 0:
        raise ConfigError(
            "algo.vf_coef=0 never trains the critic of algo.value_model=true: use algo.vf_coef > 0"
        )


def batch_splits(batch: int, group_size: int, mini_batches: int, world: int) -> bool:
    """Whether `batch` samples split over `world` ranks in whole groups of `group_size`, each rank's share in
    `mini_batches` equal mini-batches."""
    return batch % (group_size * world) == 0 and (batch // world) % mini_batches == 0


def fitting_worlds(batch: int, group_size: int, mini_batches: int, up_to: int) -> list[int]:
    """The rank counts from `up_to` down to 1 over which the batch splits (`batch_splits`), largest first."""
    return [n for n in range(up_to, 0, -1) if batch_splits(batch, group_size, mini_batches, n)]


def working_values(batch: int, group_size: int, mini_batches: int, world: int) -> str:
    """The nearest values that work, for an error message: the batch sizes around `batch` that split over
    `world` ranks, and the rank counts up to `world` that `batch` splits over."""
    step = math.lcm(group_size * world, world * mini_batches)
    below, above = batch // step * step, (batch // step + 1) * step
    sizes = " or ".join(str(b) for b in (below, above) if b > 0)
    worlds = fitting_worlds(batch, group_size, mini_batches, world)
    return (
        f"with {world} ranks use trainer.train_batch_size={sizes}; with {batch}, use "
        f"{' or '.join(map(str, worlds[:3]))} ranks (trainer.num_processes, torchrun's --nproc-per-node, or "
        "fewer visible GPUs)"
    )


def validate(cfg: RLConfig, *, world_size: int = 1) -> None:
    """Raise `ConfigError` for a configuration that cannot work; fix up harmless omissions (logged).

    `world_size` is the number of ranks the run will use (the batch must split evenly over them).
    """
    m, r, a, t, lg = cfg.model, cfg.rollout, cfg.algo, cfg.trainer, cfg.logger
    if not m.path or m.path == "???":
        raise ConfigError(
            "model.path is missing: set model.path=<hub id | local dir | smollm2-135m>, or start from a "
            "recipe (+recipe=quickstart runs offline)"
        )
    nonempty("model.path", m.path)
    if r.temperature == 0:
        raise ConfigError(
            "rollout.temperature=0 (greedy) cannot train: every sample of a group would be identical; "
            "use a temperature > 0"
        )
    check_ranges(cfg)
    _algo_names(a)
    _algo_rules(cfg)
    if a.rollout_is.enabled is None:
        a.rollout_is.enabled = t.mode == "async"  # decoupled PPO: weight proximal against behaviour
    if (a.rollout_is.enabled or a.rollout_kl_coef > 0) and not r.return_logprobs:
        # Both need the engine's log-probs; the engines always can return them, so turn them on.
        log.warning(
            "algo.rollout_is.enabled / algo.rollout_kl_coef need rollout log-probs: "
            "setting rollout.return_logprobs=true"
        )
        r.return_logprobs = True
    if t.train_batch_size % r.group_size:
        raise ConfigError(
            f"trainer.train_batch_size={t.train_batch_size} must be divisible by "
            f"rollout.group_size={r.group_size} (it counts samples = prompts x group size)"
        )
    if t.train_batch_size % (r.group_size * world_size):
        raise ConfigError(
            f"trainer.train_batch_size={t.train_batch_size} must be divisible by rollout.group_size x ranks "
            f"= {r.group_size} x {world_size} (each rank samples whole groups); "
            + working_values(t.train_batch_size, r.group_size, a.mini_batches, world_size)
        )
    if (t.train_batch_size // world_size) % a.mini_batches:
        raise ConfigError(
            f"algo.mini_batches={a.mini_batches} must divide the per-rank batch "
            f"{t.train_batch_size // world_size} (trainer.train_batch_size / ranks); "
            + working_values(t.train_batch_size, r.group_size, a.mini_batches, world_size)
        )
    if len(t.betas) != 2 or any(b is None or not 0 <= b < 1 for b in t.betas):
        raise ConfigError(f"trainer.betas={list(t.betas)!r} must be two values in [0, 1), e.g. [0.9, 0.999]")
    optimizer_steps = derive(cfg).optimizer_steps
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
    choice("logger.backend", lg.backend, BACKENDS)
    nonempty("logger.name", lg.name)
    if lg.backend == "wandb":
        nonempty("logger.project", lg.project)
        for tag in lg.tags:
            if not isinstance(tag, str) or not 1 <= len(tag) <= 64:
                raise ConfigError(f"logger.tags: {tag!r} must be 1 to 64 characters (a W&B limit)")


def local_path_exists(key: str, path: str | None) -> None:
    """A value that looks like a local path (starts with / . or ~) must exist."""
    if path and path.startswith(("/", ".", "~")) and not Path(path).expanduser().exists():
        raise ConfigError(f"{key}={path!r} does not exist (a local path: it starts with / . or ~)")


def model_folder_ok(key: str, path: str | None) -> None:
    """A local model folder's tokenizer and config files are regular files of a bounded size, its weights
    safetensors files whose shapes agree with config.json (rlkit.model_files.check_model_folder); ConfigError
    naming `key`, the file and, for a size, the config key."""
    if not path:
        return
    try:
        check_model_folder(path)
    except ModelFolderError as e:
        raise ConfigError(f"{key}={path!r}: {e}") from None


def fits_type(value, tp) -> bool:
    """Whether a config value (YAML: bool, int, float, str, list, dict, null) fits the annotation `tp`.
    Lenient where the annotation says nothing checkable (Any, a class of its own, a forward reference)."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if tp is typing.Any or isinstance(tp, (str, typing.ForwardRef)):
        return True
    if origin is typing.Union or type(tp).__name__ == "UnionType":
        return any(fits_type(value, a) for a in args)
    if origin is typing.Literal:
        return value in args
    if tp is type(None) or tp is None:
        return value is None
    if tp is bool:
        return isinstance(value, bool)
    if tp is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if tp is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if tp is str:
        return isinstance(value, str)
    if origin in (list, tuple, set, frozenset) or tp in (list, tuple, set, frozenset):
        return isinstance(value, (list, tuple))
    if origin is dict or tp is dict:
        return isinstance(value, dict)
    return True  # a config class, a callable, ...: the consumer checks it


def type_name(tp) -> str:
    """An annotation as a user reads it: `float | None`, `one of ['auto', 'fp8']`."""
    if typing.get_origin(tp) is typing.Literal:
        return f"one of {list(typing.get_args(tp))}"
    if isinstance(tp, type):
        return tp.__name__
    return str(tp).replace("typing.", "")
