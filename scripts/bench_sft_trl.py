"""rlkit's SFT (`python -m rlkit.sft`) against TRL's SFTTrainer on the same rows, model, seed and settings: the
per-step training loss of each over the first steps, and the step time.

    python scripts/bench_sft_trl.py --model smollm2-135m --steps 10 --batch 8
    python scripts/bench_sft_trl.py --model DIR --steps 4 --batch 4 --json     # one JSON object for machines

Both train on the sft_quickstart recipe's rows (the arithmetic task's worked solutions, each a prompt templated as
rlkit's RL prompts are and the answer as the assistant's turn; TRL gets them as a conversational prompt/completion
dataset, its completion-only loss), in the same order (rlkit's seeded order; TRL with
`train_sampling_strategy="sequential"` over the rows listed in that order), trainer.train_batch_size rows a step,
AdamW at the same learning rate with a cosine schedule and no warm-up (the two frameworks' warm-ups differ:
rlkit's first step runs at lr/(w+1), transformers' at 0), gradient clipping at 1.0, fp32 on the CPU, no
packing, the loss the token mean over the batch's completion tokens. Each runs in its own child process, one
after the other. The loss of step 1 is the untrained model's (the same weights, the same rows): it must agree to
float rounding; later steps drift apart only by the rounding of two different sums, so the check is relative,
`--tolerance` (default 1e-3) on every step compared. Exit status 1 when a step is outside it.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def overrides(args, run_dir: str) -> list[str]:
    return [
        "+recipe=sft_quickstart", f"model.path={args.model}", f"trainer.run_dir={run_dir}", "sft.epochs=null",
        f"trainer.steps={args.steps}", f"trainer.train_batch_size={args.batch}", f"trainer.lr={args.lr}",
        "trainer.warmup_steps=0", "trainer.lr_schedule=cosine", f"trainer.seed={args.seed}", "data.eval_size=0",
        "trainer.eval_at_start=false", "trainer.save_every=0", "trainer.device=cpu", "trainer.progress_bar=false",
        "trainer.curves=false", "logger=none", "model.dtype=float32", "model.compute_dtype=float32",
    ]  # fmt: skip


def run_rlkit(args) -> dict:
    from rlkit import sft
    from rlkit.train import compose

    with tempfile.TemporaryDirectory() as tmp:
        history = sft.run(sft.load_config(compose(overrides(args, f"{tmp}/run"))))
    steps = [
        {"step": i + 1, "loss": h["loss"], "seconds": h["perf/step_seconds"]} for i, h in enumerate(history)
    ]
    return {"framework": "rlkit", "steps": steps}


def trl_rows(args):
    """(the model path, TRL's dataset in rlkit's order, rlkit's config) of the run `overrides` composes."""
    import datasets

    from rlkit import sft
    from rlkit.data.loading import load_splits
    from rlkit.data.prompts import PromptOrder, prompt_messages
    from rlkit.models import resolve_model
    from rlkit.train import compose

    cfg = sft.load_config(compose(overrides(args, tempfile.mkdtemp())))
    _, rows, _ = sft.rows_and_steps(cfg)
    if rows.dropped:
        raise SystemExit(f"{rows.dropped} rows dropped by sft.max_length: the row orders would differ")
    train, _ = load_splits(cfg.data, seed=cfg.trainer.seed)
    d, answer_key = cfg.data, cfg.sft.completion_key or cfg.data.answer_key
    order = PromptOrder(len(train), cfg.trainer.seed).next(args.steps * args.batch)
    ds = datasets.Dataset.from_list(
        [
            {
                "prompt": prompt_messages(train[i][d.prompt_key], d),
                "completion": [{"role": "assistant", "content": train[i][answer_key]}],
            }
            for i in order
        ]
    )
    return resolve_model(cfg.model.path)[0], ds, cfg


def run_trl(args) -> dict:
    import torch
    from transformers import AutoModelForCausalLM, TrainerCallback
    from trl import SFTConfig, SFTTrainer

    from rlkit.models import load_tokenizer

    path, ds, cfg = trl_rows(args)
    torch.manual_seed(args.seed)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    losses, seconds, started = [], [], {}

    class Clock(TrainerCallback):
        def on_step_begin(self, a, state, control, **kw):
            started["t"] = time.perf_counter()

        def on_step_end(self, a, state, control, **kw):
            seconds.append(time.perf_counter() - started["t"])

        def on_log(self, a, state, control, logs=None, **kw):
            if logs and "loss" in logs:
                losses.append(float(logs["loss"]))

    config = SFTConfig(
        output_dir=f"{args.workdir}/trl", per_device_train_batch_size=args.batch, max_steps=args.steps,
        learning_rate=args.lr, lr_scheduler_type="cosine", warmup_steps=0, weight_decay=0.0,
        adam_beta1=cfg.trainer.betas[0], adam_beta2=cfg.trainer.betas[1], max_grad_norm=cfg.trainer.max_grad_norm,
        max_length=cfg.sft.max_length, packing=False, padding_free=False, completion_only_loss=True,
        train_sampling_strategy="sequential", gradient_checkpointing=False, use_cpu=True, bf16=False, fp16=False,
        logging_steps=1, report_to="none", save_strategy="no", seed=args.seed, dataloader_drop_last=True,
    )  # fmt: skip
    trainer = SFTTrainer(
        model=model, args=config, train_dataset=ds, processing_class=load_tokenizer(path), callbacks=[Clock()]
    )
    trainer.train()
    steps = [{"step": i + 1, "loss": v, "seconds": s} for i, (v, s) in enumerate(zip(losses, seconds))]
    return {"framework": "trl", "steps": steps}


def compare(rl: dict, trl: dict, tolerance: float) -> dict:
    pairs = list(zip(rl["steps"], trl["steps"]))
    rel = [abs(a["loss"] - b["loss"]) / max(abs(b["loss"]), 1e-12) for a, b in pairs]

    def mean_s(run):  # the first step carries one-time costs (allocations, compilation of kernels)
        later = [s["seconds"] for s in run["steps"][1:]] or [run["steps"][0]["seconds"]]
        return sum(later) / len(later)

    return {
        "steps": [
            {"step": a["step"], "rlkit": a["loss"], "trl": b["loss"], "rel_diff": r}
            for (a, b), r in zip(pairs, rel)
        ],
        "max_rel_diff": max(rel),
        "tolerance": tolerance,
        "within": max(rel) <= tolerance and len(pairs) == len(rl["steps"]) == len(trl["steps"]),
        "mean_step_s": {"rlkit": mean_s(rl), "trl": mean_s(trl)},
        "ratio_step_time": mean_s(rl) / mean_s(trl),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--batch", type=int, default=8, help="rows a step (trainer.train_batch_size)")
    p.add_argument("--lr", type=float, default=5e-5)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--tolerance", type=float, default=1e-3, help="largest relative loss difference of a step")
    p.add_argument("--workdir", default=None)
    p.add_argument("--json", action="store_true")
    p.add_argument("--_worker", choices=["rlkit", "trl"], help=argparse.SUPPRESS)
    args = p.parse_args()
    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="bench-sft-"))
    workdir.mkdir(parents=True, exist_ok=True)
    args.workdir = str(workdir)
    if args._worker:
        result = run_rlkit(args) if args._worker == "rlkit" else run_trl(args)
        (workdir / f"{args._worker}.json").write_text(json.dumps(result))
        return
    results = {}
    for name in ("rlkit", "trl"):  # each in its own process: no shared threads, caches or memory
        cmd = [sys.executable, __file__, *sys.argv[1:], "--workdir", str(workdir), "--_worker", name]
        proc = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO)
        if proc.returncode != 0:
            raise SystemExit(f"{name} failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}")
        results[name] = json.loads((workdir / f"{name}.json").read_text())
    summary = compare(results["rlkit"], results["trl"], args.tolerance)
    if args.json:
        print(json.dumps(summary))
    else:
        print(f"{'step':>4} {'rlkit loss':>12} {'TRL loss':>12} {'rel diff':>10}")
        for s in summary["steps"]:
            print(f"{s['step']:>4} {s['rlkit']:>12.6f} {s['trl']:>12.6f} {s['rel_diff']:>10.2e}")
        t = summary["mean_step_s"]
        print(f"max rel diff {summary['max_rel_diff']:.2e} (tolerance {args.tolerance:g}): "
              f"{'within' if summary['within'] else 'OUTSIDE'}")  # fmt: skip
        print(f"mean step time (steps 2+): rlkit {t['rlkit']:.3f} s, TRL {t['trl']:.3f} s, "
              f"ratio {summary['ratio_step_time']:.2f}")  # fmt: skip
    sys.exit(0 if summary["within"] else 1)


if __name__ == "__main__":
    main()
