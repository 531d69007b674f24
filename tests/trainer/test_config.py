"""Every recipe composes and validates; each validation error names the key, the value and the choices."""

import logging

import pytest
from hydra import compose, initialize_config_dir

from rlkit.config import CONFIG_DIR, RECIPE_DIR, ConfigError, load_config, register_configs

RECIPES = sorted(p.stem for p in RECIPE_DIR.glob("*.yaml"))


def _compose(overrides):
    register_configs()
    with initialize_config_dir(str(CONFIG_DIR), version_base=None):
        return compose("config", overrides=overrides)


def test_all_four_recipes_exist():
    assert {"grpo_gsm8k", "ppo_gsm8k", "dr_grpo_gsm8k", "quickstart"} <= set(RECIPES)


@pytest.mark.parametrize("recipe", RECIPES)
def test_recipe_composes_and_validates(recipe):
    cfg = load_config(_compose([f"+recipe={recipe}"]))
    assert cfg.trainer.train_batch_size % cfg.rollout.group_size == 0
    assert cfg.model.path


def test_recipe_overrides_group_choice():
    ppo = load_config(_compose(["+recipe=ppo_gsm8k"]))
    assert ppo.algo.adv_estimator == "gae" and ppo.algo.value_model and ppo.algo.kl_in_reward
    dr = load_config(_compose(["+recipe=dr_grpo_gsm8k"]))
    assert not dr.algo.norm_by_std and dr.algo.loss_agg_mode == "seq-mean-token-sum-norm"
    quick = load_config(_compose(["+recipe=quickstart"]))
    assert quick.model.path == "smollm2-135m" and quick.data.path == "arithmetic"
    assert quick.rollout.engine == "hf" and quick.model.dtype == "float32"


def test_command_line_override_wins_over_recipe():
    cfg = load_config(_compose(["+recipe=quickstart", "trainer.steps=3", "rollout.group_size=2"]))
    assert cfg.trainer.steps == 3 and cfg.rollout.group_size == 2


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["algo.kl_estimator=k5"], "algo.kl_estimator='k5' is not one of ['k1', 'abs', 'k2', 'k3']"),
        (["algo.policy_loss=ppo"], "algo.policy_loss='ppo' is not one of ['ppo_clip', 'gspo', 'cispo']"),
        (["algo.loss_agg_mode=mean"], "algo.loss_agg_mode='mean' is not one of"),
        (["algo.adv_estimator=vtrace"], "algo.adv_estimator='vtrace' is not one of"),
        (
            ["algo.rollout_is.level=seq"],
            "algo.rollout_is.level='seq' is not one of ['token', 'sequence', 'geometric']",
        ),
        (["algo.rollout_is.mode=clip"], "algo.rollout_is.mode='clip' is not one of"),
        (["rollout.engine=sglang"], "rollout.engine='sglang' is not one of ['auto', 'hf', 'vllm']"),
        (["logger=console", "logger.backend=tensorboard"], "logger.backend='tensorboard' is not one of"),
        (["model.dtype=fp8"], "model.dtype='fp8' is not one of"),
        (
            ["trainer.train_batch_size=10", "rollout.group_size=4"],
            "trainer.train_batch_size=10 must be divisible by rollout.group_size=4",
        ),
        (
            ["algo.rollout_is.lower=3.0", "algo.rollout_is.upper=2.0"],
            "algo.rollout_is.lower=3.0 must be below algo.rollout_is.upper=2.0",
        ),
        (
            ["algo.rollout_is.veto_lower=0.5", "algo.rollout_is.veto_upper=0.1"],
            "algo.rollout_is.veto_lower=0.5 must be below",
        ),
        (
            ["rollout.group_size=1", "trainer.train_batch_size=4"],
            "algo.norm_by_std=true needs rollout.group_size >= 2",
        ),
        (["model.path=''"], "model.path is missing"),
        (["algo.dual_clip=0.5"], "algo.dual_clip=0.5 must be > 1"),
        (["algo=ppo", "algo.value_model=false"], "algo.adv_estimator='gae' needs a critic"),
        (["data.arithmetic_kinds=[times]"], "data.arithmetic_kinds=['times'] must be a non-empty subset of"),
        (["rollout.mismatch_samples=-1"], "rollout.mismatch_samples"),
    ],
)
def test_validation_errors(overrides, message):
    with pytest.raises(ConfigError) as err:
        load_config(_compose(["+recipe=quickstart", *overrides]))
    assert message in str(err.value)


def test_batch_must_split_over_ranks():
    cfg = _compose(["+recipe=quickstart", "trainer.train_batch_size=12", "rollout.group_size=4"])
    load_config(cfg, world_size=1)
    with pytest.raises(
        ConfigError,
        match=r"trainer.train_batch_size=12 must be divisible by rollout.group_size x ranks = 4 x 2",
    ):
        load_config(cfg, world_size=2)


def test_missing_model_path_without_recipe():
    with pytest.raises(ConfigError, match="model.path is missing"):
        load_config(_compose(["model.path=???"]))


def test_unknown_key_is_rejected_by_the_schema():
    with pytest.raises(Exception, match="lr_rate"):
        _compose(["+recipe=quickstart", "trainer.lr_rate=1"])


def test_rollout_is_without_logprobs_turns_them_on(caplog):
    cfg = _compose(["+recipe=quickstart", "rollout.return_logprobs=false", "algo.rollout_is.enabled=true"])
    with caplog.at_level(logging.WARNING):
        config = load_config(cfg)
    assert config.rollout.return_logprobs is True
    assert "setting rollout.return_logprobs=true" in caplog.text
    cfg = _compose(["+recipe=quickstart", "rollout.return_logprobs=false", "algo.rollout_kl_coef=0.1"])
    assert load_config(cfg).rollout.return_logprobs is True
