"""Build an `RLConfig` for a learner test from flat keyword names (`lr=`, `kl_coef=`, `model_path=` ...)."""

from __future__ import annotations

from rlkit.config.schema import RLConfig

# flat test name -> dotted config key
FLAT = {
    "model_path": "model.path",
    "dtype": "model.dtype",
    "compute_dtype": "model.compute_dtype",
    "gradient_checkpointing": "model.gradient_checkpointing",
    "lora_rank": "model.lora.rank",
    "lora_alpha": "model.lora.alpha",
    "lora_dropout": "model.lora.dropout",
    "lora_target_modules": "model.lora.target_modules",
    "strategy": "trainer.strategy",
    "device": "trainer.device",
    "lr": "trainer.lr",
    "weight_decay": "trainer.weight_decay",
    "betas": "trainer.betas",
    "warmup_steps": "trainer.warmup_steps",
    "lr_schedule": "trainer.lr_schedule",
    "max_grad_norm": "trainer.max_grad_norm",
    "max_tokens_per_microbatch": "trainer.max_tokens_per_microbatch",
    "pack_sequences": "trainer.pack_sequences",
    "logprob_chunk_tokens": "trainer.logprob_chunk_tokens",
    "total_steps": "trainer.steps",  # optimizer steps = steps with one epoch and one mini-batch
    "seed": "trainer.seed",
    "collective_timeout_s": "trainer.collective_timeout_s",
    "temperature": "rollout.temperature",
    "top_k": "rollout.top_k",
    "top_p": "rollout.top_p",
}
ALGO = (
    "policy_loss", "clip_low", "clip_high", "dual_clip", "loss_agg_mode", "norm_len", "kl_coef", "kl_estimator",
    "kl_in_reward", "rollout_kl_coef", "rollout_kl_estimator", "entropy_coef", "value_model", "vf_coef",
    "value_clip", "ppo_epochs", "mini_batches",
)  # fmt: skip


def learner_cfg(**flat) -> RLConfig:
    """An `RLConfig` with the flat keywords set (the rest schema defaults); `max_grad_norm=None` = no clipping.

    On a machine with CUDA the learner stays on the CPU unless `device=` says otherwise, as in CPU CI (see
    `as_in_cpu_ci`): the learner tests compare 2-process gloo runs with a 1-process reference on one device,
    and their rank 1 would ask for a cuda:1 a 1-GPU host lacks. The learner on CUDA is scripts/gpu_check.py's.
    """
    if cuda_gpus():
        flat.setdefault("device", "cpu")
    cfg = RLConfig()
    for name, value in flat.items():
        key = f"algo.{name}" if name in ALGO else FLAT[name]
        if name == "max_grad_norm" and value is None:
            value = float("inf")
        *path, leaf = key.split(".")
        node = cfg
        for part in path:
            node = getattr(node, part)
        setattr(node, leaf, value)
    return cfg


def cuda_gpus() -> int:
    """CUDA devices this test process sees (0 on CPU CI)."""
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


# What the trainer tests pin on a machine with CUDA, unless a test sets the key itself.
AS_IN_CPU_CI = (("trainer.device", "cpu"), ("rollout.engine", "hf"))


def as_in_cpu_ci(args: list[str]) -> list[str]:
    """The trainer tests' launch lines, run on a machine with CUDA as they run in CPU CI.

    They compare runs whose expected numbers hold on one device (one process against two, a resumed run
    against a straight one), and their multi-process runs would become NCCL runs asking for cuda:1 on a host
    with one GPU. So on CUDA they keep the learner on the CPU (`trainer.device=cpu`: gloo) and the engine to
    the HF one on the CPU (`auto` would pick vLLM's CUDA build, which takes a GPU whatever trainer.device says),
    unless a test sets either itself. What only a GPU can test carries the `gpu` marker, and
    scripts/gpu_check.py runs the learner under FSDP2/NCCL on CUDA.
    """
    if not cuda_gpus():
        return list(args)
    given = {a.lstrip("+").split("=", 1)[0] for a in args}
    return [*args, *(f"{key}={value}" for key, value in AS_IN_CPU_CI if key not in given)]
