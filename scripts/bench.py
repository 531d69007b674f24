"""Benchmark N GRPO steps of rlkit (and, with --compare-trl, of TRL's GRPOTrainer at equal settings).

    python scripts/bench.py --model smollm2-135m --prompts 4 --group 4 --max-new-tokens 32 --steps 20
    python scripts/bench.py ... --compare-trl          # then TRL on the same model, prompts, rewards
    python scripts/bench.py ... --json                 # one JSON object for machines

Both frameworks run the quickstart_1digit recipe's task (the quickstart until 2026-11-23: its data, prompt
template, system prompt and the exact-answer `math` reward; TRL gets them from rlkit's own composed config),
the same model, group size, prompts per step, max new tokens, temperature, learning rate (constant), no KL
term, token-mean loss over the global batch (TRL `loss_type="dapo"`), one optimizer step per batch, fp32 on
CPU. The defaults are that recipe's settings. Each runs in its
own child process, one after the other, so neither inherits the other's threads, caches or memory.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


# ----------------------------------------------------------------------------------------------- rlkit


def rlkit_overrides(args) -> list[str]:
    """Hydra overrides that put the quickstart_1digit recipe at the benchmark's settings."""
    return [
        "+recipe=quickstart_1digit",
        f"model.path={args.model}",
        f"model.dtype={args.dtype}",
        f"rollout.engine={args.engine}",
        f"rollout.group_size={args.group}",
        f"rollout.max_new_tokens={args.max_new_tokens}",
        f"rollout.temperature={args.temperature}",
        f"trainer.train_batch_size={args.prompts * args.group}",
        f"trainer.steps={args.steps}",
        f"trainer.lr={args.lr}",
        "trainer.warmup_steps=0",
        "trainer.lr_schedule=constant",
        f"trainer.seed={args.seed}",
        f"trainer.device={args.device}",
        "trainer.eval_every=0",
        "data.eval_size=0",
        "trainer.save_every=0",
        "trainer.resume=none",
        "algo.kl_coef=0.0",
        "algo.loss_agg_mode=token-mean",
        f"trainer.run_dir={args.workdir}/rlkit",
        "trainer.progress_bar=false",
        "logger=none",
    ] + list(args.rlkit_override)


def run_rlkit(args) -> dict:
    from rlkit.train import compose, load_config
    from rlkit.trainer import Trainer

    t0 = time.perf_counter()
    trainer = Trainer(load_config(compose(rlkit_overrides(args))))
    setup_s = time.perf_counter() - t0
    # Wall clock at the end of each step, as TRL's on_step_end below: everything between steps counts.
    ends: list[float] = []
    step = trainer.train_step

    def timed_step():
        metrics = step()
        ends.append(time.perf_counter())
        return metrics

    trainer.train_step = timed_step
    t_start = time.perf_counter()
    try:
        history = trainer.train()
    finally:
        trainer.close()
    steps = [
        {"step": i + 1, "seconds": end - t_start, "reward": m.get("reward/mean"), "metrics": m}
        for i, (end, m) in enumerate(zip(ends, history))
    ]
    return {"framework": "rlkit", "setup_s": setup_s, "steps": steps}


# ----------------------------------------------------------------------------------------------- TRL


def run_trl(args) -> dict:
    import datasets
    import torch
    from transformers import TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from rlkit.data.loading import load_splits
    from rlkit.models import load_tokenizer, resolve_model
    from rlkit.rewards import resolve
    from rlkit.train import compose, load_config

    # The very config rlkit runs with: same data, prompt template, system prompt and reward.
    cfg = load_config(compose(rlkit_overrides(args)))
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

    times: list[float] = []
    rewards: list[float] = []

    class Clock(TrainerCallback):
        def on_step_end(self, a, state, control, **kw):
            times.append(time.perf_counter() - t_start)

        def on_log(self, a, state, control, logs=None, **kw):
            if logs and "reward" in logs:
                rewards.append(float(logs["reward"]))

    cfg = GRPOConfig(
        output_dir=f"{args.workdir}/trl",
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
    )
    trainer = GRPOTrainer(
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
        {"step": i + 1, "seconds": t, "reward": rewards[i] if i < len(rewards) else None}
        for i, t in enumerate(times)
    ]
    return {"framework": "trl", "steps": steps}


# ----------------------------------------------------------------------------------------------- report


def step_seconds(result: dict) -> list[float]:
    ts = [0.0] + [s["seconds"] for s in result["steps"]]
    return [b - a for a, b in zip(ts, ts[1:])]


def median(xs: list[float]) -> float:
    xs = sorted(xs)
    n = len(xs)
    return xs[n // 2] if n % 2 else 0.5 * (xs[n // 2 - 1] + xs[n // 2])


def mean_after_first(xs: list[float]) -> float:
    """Mean seconds per step, leaving out step 1 (warm-up: lazy imports, first allocations)."""
    rest = xs[1:] or xs
    return sum(rest) / len(rest)


def moving_average(xs: list[float], window: int) -> list[float]:
    """Means of each full window of `window` consecutive values (len(xs) - window + 1 of them)."""
    return [sum(xs[i : i + window]) / window for i in range(len(xs) - window + 1)]


def time_to_reward(result: dict, level: float, window: int = 5) -> float | None:
    """Wall seconds at the end of the first full `window`-step stretch whose mean training reward
    reaches `level` (None if none does): one lucky step does not count."""
    rewards = [s["reward"] if s["reward"] is not None else 0.0 for s in result["steps"]]
    for i, avg in enumerate(moving_average(rewards, window)):
        if avg >= level:
            return result["steps"][i + window - 1]["seconds"]
    return None


PHASES = ("generate", "reward", "logprobs", "advantages", "correction", "update", "weight_push")


def rlkit_table(result: dict) -> str:
    rows = [s["metrics"] for s in result["steps"][1:]] or [s["metrics"] for s in result["steps"]]

    def avg(key):
        vals = [r[key] for r in rows if isinstance(r.get(key), (int, float))]
        return sum(vals) / len(vals) if vals else float("nan")

    lines = ["phase            s/step   share"]
    total = avg("timing/step_s")
    for p in PHASES:
        v = avg(f"timing/{p}_s")
        if v == v:  # not NaN
            lines.append(f"{p:<16} {v:7.2f}  {100 * v / total:5.1f}%")
    lines.append(f"{'step':<16} {total:7.2f}")
    for key, label in (
        ("perf/gen_tokens_per_s", "generated tokens/s"),
        ("learner/tokens_per_s", "trained tokens/s (learner)"),  # counted: rows skipped as zero-std excluded
        ("learner/run_tokens", "tokens run by the learner"),
        ("perf/gen_mfu", "generation MFU"),
        ("perf/learner_mfu", "learner MFU"),
        ("perf/peak_memory_gb", "peak memory (GB)"),
    ):
        lines.append(f"{label:<24} {avg(key):10.2f}")
    return "\n".join(lines)


def child(framework: str, args, out: Path) -> dict:
    """Run one framework in a fresh Python process; its result comes back through a JSON file."""
    cmd = [sys.executable, __file__, "--_worker", framework, "--_out", str(out)] + args.argv
    # The child's own output goes to stderr, so stdout carries only the report (--json stays parseable).
    subprocess.run(cmd, check=True, cwd=REPO, stdout=sys.stderr)
    return json.loads(out.read_text())


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2-135m", help="model.path (short name, local dir or hub id)")
    p.add_argument("--prompts", type=int, default=4, help="prompts per step")
    p.add_argument("--group", type=int, default=4, help="samples per prompt (group size)")
    p.add_argument("--max-new-tokens", type=int, default=32)
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--lr", type=float, default=3e-5)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--engine", default="hf", choices=["auto", "hf", "vllm"])
    p.add_argument("--device", default="cpu", help="trainer.device (cpu / cuda)")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument(
        "--compare-trl", action="store_true", help="also run TRL's GRPOTrainer and print the ratio"
    )
    p.add_argument("--json", action="store_true", help="print one JSON object instead of tables")
    p.add_argument("--workdir", default=None, help="scratch directory (default: a temp dir)")
    p.add_argument("--rlkit-override", action="append", default=[], help="extra Hydra override for rlkit")
    p.add_argument("--_worker", choices=["rlkit", "trl"], help=argparse.SUPPRESS)
    p.add_argument("--_out", help=argparse.SUPPRESS)
    argv = sys.argv[1:] if argv is None else argv
    args = p.parse_args(argv)
    if args.workdir is None:
        args.workdir = tempfile.mkdtemp(prefix="rlkit-bench-")
    args.argv = [a for a in argv] + (["--workdir", args.workdir] if "--workdir" not in argv else [])

    if args._worker:
        result = run_rlkit(args) if args._worker == "rlkit" else run_trl(args)
        Path(args._out).write_text(json.dumps(result, default=float))
        return

    os.makedirs(args.workdir, exist_ok=True)
    results = {"rlkit": child("rlkit", args, Path(args.workdir) / "rlkit.json")}
    if args.compare_trl:
        results["trl"] = child("trl", args, Path(args.workdir) / "trl.json")

    summary = {"settings": {k: v for k, v in vars(args).items() if not k.startswith("_") and k != "argv"}}
    for name, res in results.items():
        secs = step_seconds(res)
        summary[name] = {
            "mean_step_s": mean_after_first(secs),
            "median_step_s": median(secs),
            "total_s": res["steps"][-1]["seconds"] if res["steps"] else None,
            "reward_curve": [(s["seconds"], s["reward"]) for s in res["steps"]],
        }
    if "trl" in results:
        r, t = summary["rlkit"], summary["trl"]
        summary["ratio_step_time"] = r["mean_step_s"] / t["mean_step_s"]
        # The reward level TRL reaches (best 5-step moving average), and when each framework first gets there.
        trl_rewards = [x if x is not None else 0.0 for _, x in t["reward_curve"]]
        window = min(5, len(trl_rewards))
        level = max(moving_average(trl_rewards, window))
        summary["reward_level"] = level
        summary["reward_window"] = window
        summary["time_to_level_s"] = {n: time_to_reward(results[n], level, window) for n in results}
        tr, tt = summary["time_to_level_s"]["rlkit"], summary["time_to_level_s"]["trl"]
        summary["ratio_time_to_level"] = tr / tt if tr is not None and tt else None

    if args.json:
        print(json.dumps(summary, indent=2, default=float))
        return
    print(f"\nrlkit: {args.steps} GRPO steps, {args.prompts} prompts x {args.group} samples, {args.model}")
    print(rlkit_table(results["rlkit"]))
    for name in results:
        s = summary[name]
        print(
            f"{name:<6} mean s/step (after step 1) {s['mean_step_s']:.2f}   median {s['median_step_s']:.2f}"
        )
    if "trl" in results:
        print(f"ratio rlkit/TRL seconds per step: {summary['ratio_step_time']:.2f}")
        print(
            f"reward level (TRL's best {summary['reward_window']}-step average): {summary['reward_level']:.3f}"
        )
        for n, v in summary["time_to_level_s"].items():
            print(f"  {n:<6} reaches it after {v:.1f} s" if v is not None else f"  {n:<6} never reaches it")
        if summary["ratio_time_to_level"] is not None:
            print(f"ratio rlkit/TRL time to that reward: {summary['ratio_time_to_level']:.2f}")
        print("\nreward vs seconds")
        for n in results:
            curve = " ".join(f"{t:.0f}s:{r:.2f}" for t, r in summary[n]["reward_curve"] if r is not None)
            print(f"  {n:<6} {curve}")


if __name__ == "__main__":
    main()
