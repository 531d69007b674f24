"""Every recipe composes and validates; each validation error names the key, the value and the choices."""

import logging

import pytest
from hydra import compose, initialize_config_dir

from rlkit.config.schema import CONFIG_DIR, RECIPE_DIR, ConfigError, register_configs
from rlkit.train import load_config

pytestmark = (
    pytest.mark.slow
)  # composes and checks every recipe (tens of seconds): `make test-fast` leaves it out

RECIPES = sorted(p.stem for p in RECIPE_DIR.glob("*.yaml"))


def _compose(overrides):
    register_configs()
    with initialize_config_dir(str(CONFIG_DIR), version_base=None):
        return compose("config", overrides=overrides)


def test_all_four_recipes_exist():
    assert {"grpo_gsm8k", "ppo_gsm8k", "dr_grpo_gsm8k", "quickstart", "quickstart_1digit"} <= set(RECIPES)


@pytest.fixture(scope="module")
def tiny_vl(tmp_path_factory):
    from vl_families import build_vl_family

    return build_vl_family("smolvlm", tmp_path_factory.mktemp("vl") / "model")


@pytest.fixture
def distill_teacher(tmp_path, monkeypatch, tiny_vl):
    """The working directory a user of +recipe=distill_quickstart has after `make distill-teacher`: a model
    at ./runs/distill-teacher/checkpoints/step_25/model (here a tiny one with SmolLM2's tokenizer); and that of
    a user of +recipe=grpo_see after `+recipe=sft_see`: a VL model with its processor at
    ./runs/sft-see/checkpoints/step_40/model (here the tiny Idefics3)."""
    import shutil

    from rlkit.models import make_tiny_checkpoint

    make_tiny_checkpoint(
        tmp_path / "runs/distill-teacher/checkpoints/step_25/model", hidden_size=16, num_layers=1
    )
    shutil.copytree(tiny_vl, tmp_path / "runs/sft-see/checkpoints/step_40/model")
    monkeypatch.chdir(tmp_path)


@pytest.mark.parametrize("recipe", RECIPES)
def test_recipe_composes_and_validates(recipe, distill_teacher):
    cfg = load_config(_compose([f"+recipe={recipe}"]))
    assert cfg.trainer.train_batch_size % cfg.rollout.group_size == 0
    assert cfg.model.path


def test_recipe_overrides_group_choice():
    ppo = load_config(_compose(["+recipe=ppo_gsm8k"]))
    assert ppo.algo.adv_estimator == "gae" and ppo.algo.value_model and ppo.algo.kl_in_reward
    dr = load_config(_compose(["+recipe=dr_grpo_gsm8k"]))
    assert not dr.algo.norm_by_std and dr.algo.loss_agg_mode == "seq-mean-token-sum-norm"
    geo = load_config(_compose(["+recipe=grpo_geo3k"]))
    assert geo.data.image_key == "images" and geo.model.freeze_vision and geo.reward.fn == "math"
    quick = load_config(_compose(["+recipe=quickstart"]))
    assert quick.model.path == "smollm2-135m" and quick.data.path == "arithmetic"
    # a bf16 engine, bf16 learner compute on fp32 master weights, rollout IS (docs/benchmarks.md)
    # model.dtype=auto resolves by the machine (the CPU's bf16 flags, or the GPU's: tests/learner/test_auto_dtype.py):
    # both to the same concrete dtype
    assert quick.rollout.engine == "auto" and quick.model.dtype in ("bfloat16", "float32")
    assert quick.model.compute_dtype == quick.model.dtype and quick.algo.rollout_is.enabled is True
    # fp32 as measured (its teacher need not exist to compose the recipe; load_config would check it)
    distill = _compose(["+recipe=distill_quickstart"])
    assert distill.model.dtype == distill.model.compute_dtype == "float32"
    assert distill.algo.rollout_is.enabled is False
    assert quick.algo.dynamic_sampling == "refill"
    assert quick.data.arithmetic_kinds == ["plain_add", "plain_add2"]


def test_command_line_override_wins_over_recipe():
    cfg = load_config(_compose(["+recipe=quickstart_1digit", "trainer.steps=3", "rollout.group_size=2"]))
    assert cfg.trainer.steps == 3 and cfg.rollout.group_size == 2


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["algo.kl_estimator=k5"], "algo.kl_estimator='k5' is not one of ['k1', 'abs', 'k2', 'k3']"),
        (
            ["algo.policy_loss=ppo"],
            "algo.policy_loss='ppo' is not one of ['ppo_clip', 'gspo', 'cispo', 'nll']",
        ),
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
            ["algo.rollout_is.lower=1.0", "algo.rollout_is.upper=1.0"],
            "algo.rollout_is.lower=1.0 must be below algo.rollout_is.upper=1.0",
        ),
        (
            ["algo.rollout_is.veto_lower=0.5", "algo.rollout_is.veto_upper=0.1"],
            "algo.rollout_is.veto_upper=0.1 must be > 1",
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
        load_config(_compose(["+recipe=quickstart_1digit", *overrides]))
    assert message in str(err.value)


def test_batch_must_split_over_ranks():
    cfg = _compose(["+recipe=quickstart_1digit", "trainer.train_batch_size=12", "rollout.group_size=4"])
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
        _compose(["+recipe=quickstart_1digit", "trainer.lr_rate=1"])


def test_rollout_is_without_logprobs_turns_them_on(caplog):
    cfg = _compose(
        ["+recipe=quickstart_1digit", "rollout.return_logprobs=false", "algo.rollout_is.enabled=true"]
    )
    with caplog.at_level(logging.WARNING):
        config = load_config(cfg)
    assert config.rollout.return_logprobs is True
    assert "setting rollout.return_logprobs=true" in caplog.text
    cfg = _compose(["+recipe=quickstart_1digit", "rollout.return_logprobs=false", "algo.rollout_kl_coef=0.1"])
    assert load_config(cfg).rollout.return_logprobs is True


# ------------------------------------------------------------------------------------ the key sweep
# Every key of RLConfig with at least one bad value, set on top of the valid quickstart_1digit config, and the
# words its ConfigError must contain (the user's key, and the value / choices / bound where relevant).
# A value of None means YAML null. Numbers outside their range are checked by `test_every_range`.
BAD = [
    (
        "data.tasks",
        ["chain_sums"],
        ["data.tasks: 'chain_sums' is not a reasoning-gym task"],
        {"data": {"path": "reasoning_gym"}, "reward": {"fn": "reasoning_gym"}},
    ),
    ("env.name", "nope", ["env.name='nope'"]),
    ("env.name", "os:getcwd", ["env.name='os:getcwd' is posix.getcwd, not an environment class"]),
    ("env.name", "__main__:Guess", ["env.name='__main__:Guess'", "move the class to a module"]),
    (
        "env.kwargs",
        {"role": "robot"},
        ["env.kwargs={'role': 'robot'}", "role='robot' is not one of ['user', 'tool', 'system']"],
        {"env": {"name": "calculator", "max_turns": 3}, "data": {"template": "chat"}},
    ),
    (
        "model.lora.target_modules",
        ["foo_proj"],
        [
            "model.lora.target_modules: 'foo_proj' names no linear layer of model.path='smollm2-135m'",
            "'q_proj'",
        ],
        {"model": {"lora": {"rank": 8}}},
    ),
    (
        "rollout.engine_kwargs",
        {"kv_cache_gib": "abc"},
        ["rollout.engine_kwargs.kv_cache_gib='abc' must be float | None"],
        {"rollout": {"engine": "vllm"}},
    ),
    (
        "rollout.engine_kwargs",
        {"bogus_kw": 1},
        [
            "rollout.engine_kwargs.bogus_kw=1 is not a keyword of the vllm engine",
            "'kv_cache_gib'",
            "EngineArgs",
        ],
        {"rollout": {"engine": "vllm"}},
    ),
    (
        "rollout.engine_kwargs",
        {"kv_cache_dtype": "fp9"},
        ["rollout.engine_kwargs.kv_cache_dtype='fp9' must be one of ['auto',"],
        {"rollout": {"engine": "vllm"}},
    ),
    (
        "rollout.engine_kwargs",
        {"kv_cache_gib": 0},
        ["rollout.engine_kwargs.kv_cache_gib=0 must be > 0"],
        {"rollout": {"engine": "vllm"}},
    ),
    ("trainer.max_staleness", 1000000, ["trainer.max_staleness=1000000 exceeds trainer.steps="]),
    ("env.kwargs", {"bogus": 1}, ["env.kwargs={'bogus': 1}"]),
    ("reward.route_by", [1], ["reward.route_by"]),
    ("reward.routes", {"a": "math"}, ["reward.routes={'a': 'math'} needs reward.route_by"]),
    ("trainer.pack_sequences", "maybe", ["trainer.pack_sequences", "maybe"]),
    ("trainer.strategy", "zero3", ["trainer.strategy='zero3' is not one of"]),
    ("model.path", "", ["model.path is missing"]),
    ("model.path", "/no/such/model", ["model.path='/no/such/model' does not exist"]),
    ("model.dtype", "float16", ["model.dtype='float16' is not supported", "['auto', 'float32', 'bfloat16']"]),
    ("model.dtype", "fp8", ["model.dtype='fp8' is not one of ['auto', 'float32', 'bfloat16']"]),
    (
        "model.compute_dtype",
        "float16",
        ["model.compute_dtype='float16' is not one of ['auto', 'float32', 'bfloat16']"],
    ),
    ("model.gradient_checkpointing", "maybe", ["model.gradient_checkpointing", "maybe"]),
    ("model.lora.target_modules", [], ["model.lora.target_modules=[] must be a non-empty list"]),
    ("data.path", "", ["data.path is missing"]),
    ("data.path", "/no/such/file.jsonl", ["data.path='/no/such/file.jsonl' does not exist"]),
    ("data.subset", [1], ["data.subset"]),
    ("data.train_split", "", ["data.train_split='' must be a non-empty string"]),
    ("data.eval_split", {"a": 1}, ["data.eval_split"]),
    ("data.prompt_key", "answer", ["data.prompt_key and data.answer_key are both 'answer'"]),
    ("data.answer_key", "", ["data.answer_key='' must be a non-empty string"]),
    ("data.template", "jinja", ["data.template='jinja' is not one of ['chat', 'plain']"]),
    ("data.image_key", "answer", ["data.image_key='answer' must be a column name other than"]),
    (
        "data.image_key",
        "image",
        ["data.image_key='image' gives images, but model.path='smollm2-135m' is a text-only"],
    ),
    ("data.resize_images", "maybe", ["data.resize_images", "maybe"]),
    ("model.freeze_vision", "maybe", ["model.freeze_vision", "maybe"]),
    ("model.freeze_language", "maybe", ["model.freeze_language", "maybe"]),
    ("sft.generation_eval", "maybe", ["sft.generation_eval", "maybe"]),
    (
        "data.picture_kinds",
        ["shapes"],
        ["data.picture_kinds=['shapes'] must be a non-empty subset of"],
        {"data": {"path": "pictures"}},
    ),
    ("data.system_prompt", [1], ["data.system_prompt"]),
    ("data.instruction", {"a": 1}, ["data.instruction"]),
    ("data.num_train", 400, ["data.num_train + data.num_eval = 440 exceeds the 400 distinct problems"]),
    ("data.arithmetic_kinds", [], ["data.arithmetic_kinds=[] must be a non-empty subset of"]),
    ("rollout.engine", "sglang", ["rollout.engine='sglang' is not one of ['auto', 'hf', 'vllm']"]),
    ("rollout.temperature", 0, ["rollout.temperature=0 (greedy) cannot train"]),
    ("rollout.stop", [""], ["rollout.stop=['']: a stop string must be non-empty"]),
    ("rollout.return_logprobs", "maybe", ["rollout.return_logprobs", "maybe"]),
    ("rollout.verify_push", "maybe", ["rollout.verify_push", "maybe"]),
    ("rollout.seed_per_prompt", "maybe", ["rollout.seed_per_prompt", "maybe"]),
    ("rollout.ignore_eos", "maybe", ["rollout.ignore_eos", "maybe"]),
    (
        "rollout.engine_kwargs",
        {"max_batchsize": 4},
        ["rollout.engine_kwargs.max_batchsize", "max_batch_size"],
    ),
    ("rollout.engine_kwargs", {"max_batch_size": 0}, ["rollout.engine_kwargs.max_batch_size=0 must be"]),
    ("rollout.eval_temperature", 0, ["rollout.eval_group_size=4 with rollout.eval_temperature=0"]),
    ("algo.name", [1], ["algo.name"]),
    ("algo.adv_estimator", "vtrace", ["algo.adv_estimator='vtrace' is not one of"]),
    ("algo.norm_by_std", "maybe", ["algo.norm_by_std", "maybe"]),
    ("algo.mask_zero_std_groups", "maybe", ["algo.mask_zero_std_groups", "maybe"]),
    # on: the quickstart's engine returns no routes (and this CPU's vLLM cannot: no Model Runner V2)
    ("algo.routing_replay", True, ["algo.routing_replay=true needs rollout.engine=vllm"]),
    (
        "algo.policy_loss",
        "ppo",
        ["algo.policy_loss='ppo' is not one of ['ppo_clip', 'gspo', 'cispo', 'nll']"],
    ),
    ("algo.loss_agg_mode", "mean", ["algo.loss_agg_mode='mean' is not one of"]),
    ("algo.kl_estimator", "k5", ["algo.kl_estimator='k5' is not one of ['k1', 'abs', 'k2', 'k3']"]),
    ("algo.kl_in_reward", True, ["algo.kl_in_reward=true needs token-level rewards"]),
    (
        "algo.value_model",
        True,
        ["algo.value_model=true trains a critic that algo.adv_estimator='grpo' does not use", "['gae']"],
    ),
    ("algo.rollout_is.enabled", "maybe", ["algo.rollout_is.enabled", "maybe"]),
    ("algo.rollout_is.level", "seq", ["algo.rollout_is.level='seq' is not one of"]),
    ("algo.rollout_is.mode", "clip", ["algo.rollout_is.mode='clip' is not one of"]),
    ("algo.rollout_kl_estimator", "k9", ["algo.rollout_kl_estimator='k9' is not one of"]),
    ("algo.dynamic_sampling", "on", ["algo.dynamic_sampling='on' is not one of ['off', 'refill']"]),
    ("algo.filter_metric", "loss", ["algo.filter_metric='loss' is not one of ['reward', 'accuracy']"]),
    ("algo.overlong_filter", "maybe", ["algo.overlong_filter", "maybe"]),
    ("algo.teacher.dtype", "fp8", ["algo.teacher.dtype='fp8' is not one of ['auto', 'float32', 'bfloat16']"]),
    (
        "algo.teacher.path",
        "./no/such/teacher",
        ["algo.teacher.path='./no/such/teacher' does not exist", "make distill-teacher"],
        {"algo": {"distill_coef": 0.5}},
    ),
    (
        "algo.teacher.path",
        None,
        ["algo.distill_coef=0.5 > 0 needs algo.teacher.path"],
        {"algo": {"distill_coef": 0.5}},
    ),
    ("algo.distill_coef", 0.5, ["algo.distill_coef=0.5 > 0 needs algo.teacher.path"]),
    ("algo.task_coef", 0.0, ["algo.task_coef=0 and algo.distill_coef=0: nothing to learn from"]),
    ("algo.distill_gamma", "high", ["algo.distill_gamma", "high"]),
    ("reward.fn", "no_such_reward", ["reward.fn", "no_such_reward", "'math', 'format', 'none'"]),
    ("reward.fn", "none", ["reward.fn=none with no reward.model, no reward.extra and algo.distill_coef=0"]),
    ("reward.fn", "", ["reward.fn='' must be a non-empty string"]),
    ("reward.extra", {"formt": 0.1}, ["reward.extra.formt", "'math', 'format'"]),
    ("reward.extra", {"format": "nan"}, ["reward.extra.format=nan must be a finite weight"]),
    ("reward.model", "", ["reward.model='' is not a model"]),
    ("reward.model", "./no/such/rm", ["reward.model='./no/such/rm' does not exist"]),
    ("trainer.betas", [0.9], ["trainer.betas=[0.9] must be two values in [0, 1)"]),
    ("trainer.betas", [0.9, 1.0], ["trainer.betas=[0.9, 1.0] must be two values in [0, 1)"]),
    ("trainer.warmup_steps", 31, ["trainer.warmup_steps=31 exceeds the run's 30 optimizer steps"]),
    ("trainer.lr_schedule", "linear", ["trainer.lr_schedule='linear' is not one of ['constant', 'cosine']"]),
    ("trainer.eval_at_start", "maybe", ["trainer.eval_at_start", "maybe"]),
    (
        "trainer.resume",
        "/no/such/ckpt",
        ["trainer.resume='/no/such/ckpt' is not 'auto', 'none' or an existing"],
    ),
    ("trainer.run_dir", "", ["trainer.run_dir='' must be a non-empty string"]),
    ("trainer.device", "tpu", ["trainer.device='tpu' is not one of ['auto', 'cpu', 'cuda']"]),
    ("trainer.device", "cuda", ["trainer.device='cuda' but no CUDA device is visible"]),
    ("trainer.progress_bar", "maybe", ["trainer.progress_bar", "maybe"]),
    ("trainer.curves", "maybe", ["trainer.curves", "maybe"]),
    ("trainer.reuse_update_forward", "maybe", ["trainer.reuse_update_forward", "maybe"]),
    ("trainer.compile", "maybe", ["trainer.compile", "maybe"]),
    (
        "trainer.compile_backend",
        "tvm",
        ["trainer.compile_backend='tvm' is not one of ['inductor', 'aot_eager', 'eager']"],
    ),
    ("trainer.mode", "overlap", ["trainer.mode='overlap' is not one of ['sync', 'async']"]),
    (
        "logger.backend",
        "tensorboard",
        ["logger.backend='tensorboard' is not one of ['wandb', 'console', 'none']"],
    ),
    ("logger.project", "", ["logger.project='' must be a non-empty string"]),
    ("logger.entity", [1], ["logger.entity"]),
    ("logger.name", "", ["logger.name='' must be a non-empty string"]),
    ("logger.tags", ["x" * 65], ["logger.tags", "must be 1 to 64 characters"]),
    ("eval.model", "./no-such-checkpoint", ["eval.model='./no-such-checkpoint' does not exist"]),
    ("eval.base", "/no/such/base", ["eval.base='/no/such/base' does not exist"]),
    ("eval.ks", [1, 0], ["eval.ks=[1, 0]", "every k must be an integer >= 1"]),
    ("eval.seeds", [0, -3], ["eval.seeds=[0, -3]", "every seed must be an integer >= 0"]),
    ("eval.task_key", "", ["eval.task_key=''"]),
    ("sft.messages_key", "", ["sft.messages_key=''"]),
    ("sft.completion_key", " ", ["sft.completion_key=' '"]),
    ("sft.overlong", "cut", ["sft.overlong='cut'", "truncate", "drop"]),
    ("eval.output", ".", ["eval.output='.' is a directory"]),
    # cross-key rules whose key is numeric
    ("algo.vf_coef", 0.0, ["algo.vf_coef=0 never trains the critic"], {"algo": "ppo"}),
    (
        "trainer.train_batch_size",
        18,
        ["trainer.train_batch_size=18 must be divisible by rollout.group_size=4"],
    ),
    ("algo.mini_batches", 3, ["algo.mini_batches=3 must divide the per-rank batch 16"]),
    ("reward.overlong_buffer", 33, ["reward.overlong_buffer=33 must be <= rollout.max_new_tokens=32"]),
    ("rollout.group_size", 1, ["algo.norm_by_std=true needs rollout.group_size >= 2"]),
    (
        "trainer.rollout_gpus",
        3,
        [
            "trainer.train_batch_size=16 must be divisible by rollout.group_size x trainer.rollout_gpus = 4 x 3"
        ],
        {"trainer": {"mode": "async"}},
    ),
    (
        "trainer.inflight_updates",
        "sometimes",
        ["trainer.inflight_updates='sometimes' is not one of ['off', 'recompute', 'keep_kv']"],
    ),
    (
        "trainer.inflight_updates",
        "recompute",
        ["trainer.inflight_updates='recompute'", "needs trainer.mode=async"],
    ),
    (
        "trainer.inflight_updates",
        "keep_kv",
        ["trainer.inflight_updates='keep_kv'", "needs the vLLM engine", "resolves to 'hf'"],
        {"trainer": {"mode": "async"}, "rollout": {"engine": "hf"}},
    ),
]
# One value outside each numeric key's range (int keys get ints), chosen from the range by hand.
OUT_OF_RANGE = {
    "data.eval_size": -1, "data.max_prompt_tokens": 0, "data.max_image_pixels": 0, "data.num_train": 0, "data.num_eval": 0,
    "rollout.group_size": 0, "rollout.temperature": -0.5, "rollout.top_p": 1.5, "rollout.top_k": -1,
    "rollout.max_new_tokens": 0, "rollout.mismatch_samples": -1, "rollout.weight_sync_kl_threshold": 0.0,
    "rollout.accept_engine_gap": 0.0,
    "rollout.eval_group_size": 0, "rollout.eval_temperature": -1.0, "algo.rollout_is.upper": 0.5,
    "algo.rollout_is.lower": -0.1, "algo.rollout_is.veto_lower": 1.0, "algo.rollout_is.veto_upper": 1.0,
    "algo.clip_low": 1.5, "algo.clip_high": -0.1, "algo.dual_clip": 0.5, "algo.norm_len": 0,
    "algo.kl_coef": -0.1, "algo.entropy_coef": -0.01, "algo.gamma": 1.1, "algo.lam": -0.1,
    "algo.vf_coef": -1.0, "algo.value_clip": 0.0, "algo.ppo_epochs": 0, "algo.mini_batches": 0,
    "algo.rollout_kl_coef": -1.0, "algo.max_gen_batches": 0, "reward.timeout_s": 0.0,
    "algo.distill_coef": -0.5, "algo.distill_gamma": 1.5, "algo.task_coef": -1.0,
    "reward.num_workers": 0, "reward.model_weight": float("inf"), "reward.model_batch_size": 0,
    "reward.overlong_buffer": -1, "reward.overlong_penalty": -1.0, "trainer.steps": 0,
    "reward.correct_threshold": float("nan"),
    "trainer.train_batch_size": 0, "trainer.lr": -1e-6, "trainer.weight_decay": -0.1,
    "trainer.warmup_steps": -1, "trainer.max_grad_norm": -1.0, "trainer.max_tokens_per_microbatch": 0,
    "trainer.seed": -1, "trainer.eval_every": -1, "trainer.save_every": -1, "trainer.keep_last": -1,
    "trainer.num_processes": 0, "trainer.collective_timeout_s": 0.0, "trainer.logprob_chunk_tokens": -1,
    "trainer.peak_tflops": 0.0,
    "env.max_turns": 0, "env.max_total_tokens": 0, "env.timeout_s": 0.0, "reward.batch_timeout_s": 0.0,
    "env.memory_limit_mb": 32, "env.max_processes": 4, "reward.memory_limit_mb": 0,
    "reward.max_processes": 4, "reward.max_failed_steps": -1, "env.max_failed_steps": -1,
    "env.startup_timeout_s": 0.0,
    "model.lora.rank": -1, "model.lora.alpha": 0.0, "model.lora.dropout": 1.0,
    "trainer.max_staleness": -1, "trainer.rollout_gpus": 0, "trainer.max_nonfinite_steps": 0,
    "trainer.log_samples": -1, "eval.n": 0, "eval.temperature": -0.5,
    "algo.max_token_staleness": -1, "sft.max_length": 1, "sft.epochs": 0,
}  # fmt: skip


@pytest.fixture(scope="module")
def quickstart():
    """The composed quickstart_1digit config as a plain dict (what the launcher hands its worker processes)."""
    from omegaconf import OmegaConf

    return OmegaConf.to_container(_compose(["+recipe=quickstart_1digit"]), resolve=True)


def _merge(node: dict, extra: dict) -> None:
    for k, v in extra.items():
        if isinstance(v, dict) and isinstance(node.get(k), dict):
            _merge(node[k], v)
        else:
            node[k] = v


def _with(base: dict, key: str, value, extra: dict | None = None) -> dict:
    import copy

    cfg = copy.deepcopy(base)
    if extra and extra.get("algo") == "ppo":  # the ppo group: GAE with a critic
        cfg["algo"].update(adv_estimator="gae", value_model=True, kl_in_reward=False)
    for section in ("trainer", "env", "model", "rollout", "data", "algo"):
        if extra and isinstance(extra.get(section), dict):
            _merge(cfg[section], extra[section])
    *parents, leaf = key.split(".")
    node = cfg
    for p in parents:
        node = node[p]
    node[leaf] = value
    return cfg


def test_the_sweep_covers_every_key():
    from rlkit.config.rules import RANGES, numeric_keys, schema_fields

    swept = {row[0] for row in BAD} | set(OUT_OF_RANGE)
    assert set(schema_fields()) - swept == set()
    assert set(numeric_keys()) == set(RANGES) == set(OUT_OF_RANGE)


@pytest.mark.parametrize("row", BAD, ids=lambda row: f"{row[0]}={row[1]!r}"[:60])
def test_every_key_rejects_a_bad_value(quickstart, row, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # relative paths (run_dir) resolve in a scratch folder
    key, value, words, *extra = row
    if "CUDA" in words[0]:
        import torch

        if torch.cuda.is_available():
            pytest.skip("the value is valid on a machine with a GPU")
    with pytest.raises(ConfigError) as err:
        load_config(_with(quickstart, key, value, *extra))
    for w in words:
        assert w in str(err.value), (w, str(err.value))


@pytest.mark.parametrize("key", sorted(OUT_OF_RANGE))
def test_every_range(quickstart, key):
    from rlkit.config.rules import RANGES

    value = OUT_OF_RANGE[key]
    assert value not in RANGES[key]
    with pytest.raises(ConfigError) as err:
        load_config(_with(quickstart, key, value))
    assert f"{key}={value!r}" in str(err.value)


def test_ranges_by_hand():
    from rlkit.config.rules import RANGES

    grad = RANGES["trainer.max_grad_norm"]
    assert 1.0 in grad and float("inf") in grad and 1e-8 in grad
    assert -1.0 not in grad and 0.0 not in grad and float("nan") not in grad
    assert str(grad) == "> 0 (or inf)"
    top_p = RANGES["rollout.top_p"]
    assert 1.0 in top_p and 0.0 not in top_p and str(top_p) == "in (0, 1]"
    assert float("inf") not in RANGES["trainer.lr"] and float("nan") not in RANGES["trainer.lr"]


def test_hydra_plus_on_an_unknown_key_is_refused_with_close_keys():
    cfg = _compose(["+recipe=quickstart_1digit", "+trainer.stepz=3"])  # Hydra itself accepts it
    with pytest.raises(ConfigError, match=r"trainer.stepz is not a config key: did you mean trainer.steps"):
        load_config(cfg)
    cfg = _compose(["+recipe=quickstart_1digit", "+algo.rollout_is.uper=3"])
    with pytest.raises(ConfigError, match=r"algo.rollout_is.uper .*did you mean algo.rollout_is.upper"):
        load_config(cfg)
    with pytest.raises(ConfigError, match=r"optimizer is not a config key: valid keys here: \['algo',"):
        load_config(_compose(["+recipe=quickstart_1digit", "+optimizer.lr=3"]))


def test_a_wrong_type_names_the_key(quickstart):
    with pytest.raises(ConfigError, match=r"trainer.steps: Value 'abc'"):
        load_config(_with(quickstart, "trainer.steps", "abc"))


def test_boundary_values_are_accepted(quickstart, distill_teacher):
    """The edges of the ranges are valid, and so is every recipe."""
    edges = {
        "trainer.max_grad_norm": float("inf"), "trainer.lr": 0.0, "trainer.seed": 0,
        "trainer.warmup_steps": 30, "algo.clip_low": 1.0, "algo.clip_high": 0.0, "algo.gamma": 0.0,
        "algo.entropy_coef": 0.0, "rollout.top_p": 1.0, "trainer.betas": [0.0, 0.0],
        "data.eval_size": 0, "trainer.max_tokens_per_microbatch": 1, "reward.model_weight": -2.0,
        "reward.correct_threshold": -1.0,
    }  # fmt: skip
    for key, value in edges.items():
        load_config(_with(quickstart, key, value))
    for recipe in RECIPES:
        load_config(_compose([f"+recipe={recipe}"]))


@pytest.mark.parametrize(
    "key, value, extra, words",
    [
        ("reward.overlong_penalty", 1e30, {}, "reward.overlong_penalty=1e+30 swamps the reward scale"),
        ("reward.route_by", "question", {}, "reward.route_by='question' without reward.routes"),
        ("trainer.max_staleness", 2, {}, "trainer.max_staleness=2 has no effect with trainer.mode='sync'"),
        ("trainer.rollout_gpus", 2, {}, "trainer.rollout_gpus=2 has no effect with trainer.mode='sync'"),
        (
            "algo.filter_metric",
            "accuracy",
            {"algo": {"dynamic_sampling": "off"}},
            "algo.filter_metric='accuracy' has no effect with algo.dynamic_sampling='off'",
        ),
    ],
)
def test_legal_but_almost_surely_wrong_values_are_logged_at_start_up(
    quickstart, caplog, key, value, extra, words
):
    """Each warning comes from the preflight (load_config, before any model loads), for that value only."""
    base = _with(quickstart, key, value)
    if extra:
        _merge(base["algo"], extra["algo"])
    with caplog.at_level(logging.WARNING):
        load_config(base)
    assert words in caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        load_config(
            _with(
                quickstart,
                "algo.dynamic_sampling",
                "off" if extra else quickstart["algo"]["dynamic_sampling"],
            )
        )
    assert words.split(" ")[0].split("=")[0] + "=" not in caplog.text
