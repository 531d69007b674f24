"""scripts/bench.py's TRL half: TRL's GRPOTrainer at rlkit's settings, with counters around its generation
and its loss (generated tokens and seconds, learner tokens counted from its masks, learner seconds).

bench.py runs it in a child process (`--_worker trl`); see bench.py's docstring for what is compared.
"""

from __future__ import annotations

import time


def run_trl(args, overrides: list[str]) -> dict:
    """TRL's GRPOTrainer on the config that rlkit composes from `overrides` (bench.py's rlkit_overrides)."""
    import datasets
    import torch
    from transformers import TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from rlkit.data.loading import load_splits
    from rlkit.models import load_tokenizer, resolve_model
    from rlkit.rewards import resolve
    from rlkit.train import compose, load_config

    # The very config rlkit runs with: same data, prompt template, system prompt and reward.
    cfg = load_config(compose(overrides))
    torch.manual_seed(args.seed)
    model_path = resolve_model(cfg.model.path)[0]
    tok = load_tokenizer(model_path)
    d = cfg.data
    if d.template != "chat":
        raise SystemExit("--compare-trl needs data.template=chat (TRL applies the chat template itself)")
    train, _ = load_splits(d, seed=args.seed)
    system = [{"role": "system", "content": d.system_prompt}] if d.system_prompt else []

    def user(q: str) -> str:
        return f"{q}\n{d.instruction}" if d.instruction else q

    ds = datasets.Dataset.from_dict(
        {
            "prompt": [system + [{"role": "user", "content": user(q)}] for q in train[d.prompt_key]],
            "answer": train[d.answer_key],
        }
    )
    reward_fn = resolve(cfg.reward.fn)

    def reward(prompts, completions, answer, **_):
        return [reward_fn("", c[0]["content"], a) for c, a in zip(completions, answer)]

    counts: list[dict] = []  # one per step: generated tokens and seconds, learner tokens and seconds
    rewards: list[float] = []
    current = {"gen_tokens": 0, "gen_s": 0.0, "learner_tokens": 0, "learner_start": None}

    if not callable(getattr(GRPOTrainer, "_generate", None)):  # a private hook: fail loudly, never count 0
        raise SystemExit("this TRL's GRPOTrainer has no _generate(prompts) to count generated tokens in")

    class Counted(GRPOTrainer):
        """TRL's trainer with counters around its generation and its loss; the arithmetic is untouched."""

        def _generate(self, prompts):
            t0 = time.perf_counter()
            out = super()._generate(prompts)
            current["gen_s"] += time.perf_counter() - t0
            current["gen_tokens"] += sum(len(c) for c in out[1])  # completion ids, cut after EOS
            return out

        def compute_loss(self, model, inputs, *a, **kw):
            if current["learner_start"] is None:
                current["learner_start"] = time.perf_counter()
            # Every row TRL's loss sees runs through forward and backward (no zero-std row is skipped).
            real = inputs["prompt_mask"].sum() + inputs["completion_mask"].sum()
            current["learner_tokens"] += int(real)
            return super().compute_loss(model, inputs, *a, **kw)

    class Clock(TrainerCallback):
        def on_step_end(self, a, state, control, **kw):
            now = time.perf_counter()
            start = current.pop("learner_start")
            counts.append({**current, "seconds": now - t_start, "learner_s": now - start if start else 0.0})
            current.update(gen_tokens=0, gen_s=0.0, learner_tokens=0, learner_start=None)

        def on_log(self, a, state, control, logs=None, **kw):
            if logs and "reward" in logs:
                rewards.append(float(logs["reward"]))

    cfg = GRPOConfig(
        output_dir=f"{args.workdir}/trl-seed{args.seed}",
        per_device_train_batch_size=args.prompts * args.group,
        num_generations=args.group,
        max_completion_length=args.max_new_tokens,
        temperature=args.temperature,
        top_p=1.0,
        top_k=0,
        learning_rate=args.lr,
        lr_scheduler_type="constant",
        warmup_steps=0,
        max_steps=args.steps,
        beta=0.0,
        loss_type="dapo",  # global token-mean, as rlkit's token-mean
        scale_rewards="group",
        num_iterations=1,
        epsilon=0.2,
        max_grad_norm=1.0,
        gradient_checkpointing=False,  # rlkit does not checkpoint on CPU either
        use_cpu=args.device == "cpu",
        bf16=args.dtype == "bfloat16",
        logging_steps=1,
        report_to="none",
        save_strategy="no",
        seed=args.seed,
        disable_dropout=True,
        # Fixed length: EOS is masked until max_new_tokens (transformers' MinNewTokensLengthLogitsProcessor).
        generation_kwargs={"min_new_tokens": args.max_new_tokens} if args.fixed_length else None,
    )
    trainer = Counted(
        model=model_path,
        reward_funcs=reward,
        args=cfg,
        train_dataset=ds,
        processing_class=tok,
        callbacks=[Clock()],
    )
    t_start = time.perf_counter()
    trainer.train()
    steps = [
        {"step": i + 1, "reward": rewards[i] if i < len(rewards) else None, **c} for i, c in enumerate(counts)
    ]
    return {"framework": "trl", "seed": args.seed, "steps": steps}
