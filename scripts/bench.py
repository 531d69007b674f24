"""Benchmark N GRPO steps of rlkit (and, with --compare-trl, of TRL's GRPOTrainer at equal settings).

    python scripts/bench.py --model smollm2-135m --prompts 4 --group 4 --max-new-tokens 32 --steps 20
    python scripts/bench.py ... --compare-trl          # then TRL on the same model, prompts, rewards
    python scripts/bench.py ... --compare-trl --fixed-length   # throughput at equal generated lengths
    python scripts/bench.py ... --compare-trl --seeds 0,1,2    # the learning comparison over seeds
    python scripts/bench.py ... --json                 # one JSON object for machines
    python scripts/bench.py ... --workdir DIR --report-only   # re-print the report of a run in DIR
    python scripts/bench.py ... --against 8259c11 --rounds 3  # A/B: that commit and this tree, alternately

With --against REV the benchmark runs on the commit REV (A: a git worktree of it, scripts/ab.py) and on this
checkout (B) alternately, --rounds times (A B A B ...; with --compare-trl, TRL after each pair), on the same
machine in one invocation, and reports each figure for both with the ratio B/A of every round (mean, min,
max): the figures of a performance claim in the docs.

Two tables, two questions. Throughput (per framework: generated tokens/s, learner tokens/s, step time):
with --fixed-length every response is exactly --max-new-tokens tokens in both frameworks (rlkit
`rollout.ignore_eos=true`; TRL `min_new_tokens`, which masks EOS), so both do the same work per step and
step times compare (rlkit then also trains every row, as TRL does, instead of skipping zero-std groups);
without it each model stops where it samples EOS, and only the tokens/s compare.
Learner tokens are counted, not assumed: the prompt + response tokens of the rows that went through
forward and backward (rlkit `learner/tokens`, which leaves out zero-std rows it skips; TRL's prompt and
completion masks of every row its loss sees); learner seconds are the forward, backward and optimizer
step (rlkit `learner/seconds`; TRL from its loss's first call to the end of the step). Generated tokens
per second divide each step's response tokens by its generation time (rlkit's generate phase; TRL's
`_generate`). MFU (rlkit `perf/learner_mfu`, `perf/gen_mfu`) divides model FLOPs by the device's peak: on
CPU the best matmul rlkit has measured on this machine at the compute dtype (best of 5 runs at start-up and
the figures cached in `$RLKIT_CACHE/cpu_peak.json`), raised with a warning when a phase runs faster (a peak
measured under load), so it never exceeds 1; `trainer.peak_tflops` sets it. Learning (time to a reward level, per seed) only means something at natural lengths, so
--fixed-length leaves it out.

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

# scripts/ is sys.path[0]: this file runs as a script
from bench_report import learning, learning_table, rlkit_table, throughput, throughput_table

REPO = Path(__file__).resolve().parent.parent


# ----------------------------------------------------------------------------------------------- rlkit


def rlkit_overrides(args) -> list[str]:
    """Hydra overrides that put the quickstart_1digit recipe at the benchmark's settings."""
    overrides = [
        "+recipe=quickstart_1digit",
        f"model.path={args.model}",
        f"model.dtype={args.dtype}",  # the engine's weights and compute
        f"model.compute_dtype={args.dtype}",  # the learner's matmuls (fp32 master weights), like TRL's bf16=True
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
        f"trainer.run_dir={args.workdir}/rlkit-seed{args.seed}",
        "trainer.progress_bar=false",
        "logger=none",
    ]
    if args.fixed_length:
        # Equal work per step: every row trains, as in TRL (rlkit skips zero-std groups by default).
        overrides += ["rollout.ignore_eos=true", "algo.mask_zero_std_groups=false"]
    return overrides + list(args.rlkit_override)


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
        {
            "step": i + 1,
            "seconds": end - t_start,
            "reward": m.get("reward/mean"),
            # The trainer logs the generated tokens as a rate over the generate phase: undo the division.
            "gen_tokens": round(m["perf/gen_tokens_per_s"] * m["timing/generate_s"]),
            "gen_s": m["timing/generate_s"],
            "learner_tokens": m["learner/tokens"],
            "learner_s": m["learner/seconds"],
            "metrics": m,
        }
        for i, (end, m) in enumerate(zip(ends, history))
    ]
    return {"framework": "rlkit", "seed": args.seed, "setup_s": setup_s, "steps": steps}


def child(framework: str, seed: int, args, out: Path, root: Path = REPO) -> dict:
    """Run one framework and seed in a fresh Python process, with rlkit and this script from checkout `root`;
    its result comes back through a JSON file."""
    from ab import env_for

    # The A/B's own options out: a child runs one side, in a scratch directory of its own (its run_dir)
    argv = without_options(args.argv, ("--against", "--rounds", "--workdir"))
    cmd = [
        sys.executable,
        str(root / "scripts" / "bench.py"),
        "--_worker",
        framework,
        "--_out",
        str(out),
        *argv,
        "--workdir",
        str(out.with_suffix("")),
        "--seed",
        str(seed),
    ]
    # The child's own output goes to stderr, so stdout carries only the report (--json stays parseable).
    subprocess.run(cmd, check=True, cwd=root, env=env_for(root), stdout=sys.stderr)
    return json.loads(out.read_text())


def without_options(argv: list[str], names: tuple[str, ...]) -> list[str]:
    """`argv` without the options `names` and their values (`--x V` or `--x=V`)."""
    out, skip = [], False
    for a in argv:
        if skip:
            skip = False
        elif a in names:
            skip = True
        elif not a.startswith(tuple(f"{n}=" for n in names)):
            out.append(a)
    return out


def run_figures(result: dict) -> dict[str, float]:
    """The figures of one run that an A/B compares (steps 2.., `throughput`'s and rlkit's phases)."""
    t = throughput([result])
    out = {k: t[k] for k in ("mean_step_s", "gen_tokens_per_s", "learner_tokens_per_s", "learner_s_per_step")}
    if result["framework"] == "rlkit":
        rows = [s["metrics"] for s in (result["steps"][1:] or result["steps"])]
        for key in ("timing/update_s", "timing/generate_s", "timing/weight_push_s", "perf/learner_mfu"):
            values = [r[key] for r in rows if isinstance(r.get(key), (int, float))]
            if values:
                out[key] = sum(values) / len(values)
    return out


def against(args) -> dict:
    """A/B: rlkit at `args.against` (A) and this checkout (B), alternately, `args.rounds` times (TRL after each
    pair with --compare-trl). Returns the comparison (scripts/ab.py) with TRL's ratios."""
    import ab

    workdir = Path(args.workdir)
    a_root, sha = ab.checkout(args.against, workdir)
    sides = [("A", a_root, "rlkit"), ("B", REPO, "rlkit")] + (
        [("TRL", REPO, "trl")] if args.compare_trl else []
    )
    runs: dict[str, list[dict]] = {name: [] for name, _, _ in sides}
    loads: dict[str, list[str]] = {name: [] for name, _, _ in sides}
    started = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    for i in range(args.rounds):
        for name, root, framework in sides:
            before = os.getloadavg()[0]
            result = child(framework, args.seed, args, workdir / f"{name}-{i}.json", root)
            loads[name].append(f"{before:.1f}/{os.getloadavg()[0]:.1f}")
            runs[name].append(run_figures(result))
    out = {
        "against": sha[:12], "a_root": str(a_root), "b": ab.describe_b(), "rounds": args.rounds,
        "cpu": ab.cpu_name(), "started": started, "loads": loads, "table": ab.compare(runs["A"], runs["B"]),
        "runs": runs,
    }  # fmt: skip
    if args.compare_trl:
        trl = [r["mean_step_s"] for r in runs["TRL"]]
        for side in ("A", "B"):
            ratios = [r["mean_step_s"] / t for r, t in zip(runs[side], trl)]
            out[f"{side}_over_trl_step_s"] = {
                "mean": sum(ratios) / len(ratios),
                "min": min(ratios),
                "max": max(ratios),
            }
    return out


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
    p.add_argument("--seeds", default=None, help="comma-separated seeds, one run per seed (default: --seed)")
    p.add_argument("--engine", default="hf", choices=["auto", "hf", "vllm"])
    p.add_argument("--device", default="cpu", help="trainer.device (cpu / cuda)")
    p.add_argument(
        "--dtype",
        default="float32",
        choices=["float32", "bfloat16"],
        help="bfloat16: bf16 matmuls on fp32 master weights in both (rlkit: model.compute_dtype and a bf16 engine; "
        "TRL: bf16=True)",
    )
    p.add_argument(
        "--compare-trl", action="store_true", help="also run TRL's GRPOTrainer and print the ratio"
    )
    p.add_argument(
        "--fixed-length",
        action="store_true",
        help="every response exactly --max-new-tokens tokens in both frameworks (no learning table)",
    )
    p.add_argument(
        "--reward-level",
        type=float,
        default=None,
        help="the learning table's reward level (default: the median of TRL's seeds' best 5-step means)",
    )
    p.add_argument("--json", action="store_true", help="print one JSON object instead of tables")
    p.add_argument(
        "--report-only",
        action="store_true",
        help="run nothing: print the report of the worker results already in --workdir (same options)",
    )
    p.add_argument("--workdir", default=None, help="scratch directory (default: a temp dir)")
    p.add_argument("--rlkit-override", action="append", default=[], help="extra Hydra override for rlkit")
    p.add_argument("--against", default=None, help="A/B against this commit (see the module docstring)")
    p.add_argument("--rounds", type=int, default=3, help="with --against: A B pairs (default 3)")
    p.add_argument("--_worker", choices=["rlkit", "trl"], help=argparse.SUPPRESS)
    p.add_argument("--_out", help=argparse.SUPPRESS)
    argv = sys.argv[1:] if argv is None else argv
    args = p.parse_args(argv)
    if args.workdir is None:
        args.workdir = tempfile.mkdtemp(prefix="rlkit-bench-")
    args.argv = [a for a in argv] + (["--workdir", args.workdir] if "--workdir" not in argv else [])

    if args._worker:
        if args._worker == "rlkit":
            result = run_rlkit(args)
        else:
            from bench_trl import run_trl  # scripts/ is sys.path[0]: this file runs as a script

            result = run_trl(args, rlkit_overrides(args))
        Path(args._out).write_text(json.dumps(result, default=float))
        return

    os.makedirs(args.workdir, exist_ok=True)
    if args.against:
        import ab

        result = against(args)
        print(json.dumps(result, indent=1, default=float) if args.json else ab.report(result))
        for side in ("A", "B"):
            if f"{side}_over_trl_step_s" in result and not args.json:
                r = result[f"{side}_over_trl_step_s"]
                print(
                    f"{side}/TRL seconds per step: {r['mean']:.3f} (min {r['min']:.3f}, max {r['max']:.3f})"
                )
        return
    seeds = [int(x) for x in args.seeds.split(",")] if args.seeds else [args.seed]
    frameworks = ["rlkit", "trl"] if args.compare_trl else ["rlkit"]
    out = Path(args.workdir)
    results = {
        name: [
            json.loads((out / f"{name}-seed{seed}.json").read_text())
            if args.report_only
            else child(name, seed, args, out / f"{name}-seed{seed}.json")
            for seed in seeds
        ]
        for name in frameworks
    }

    settings = {k: v for k, v in vars(args).items() if not k.startswith("_") and k != "argv"}
    summary = {
        "settings": {**settings, "seeds": seeds},
        "mode": "fixed-length" if args.fixed_length else "natural lengths",
        "throughput": {name: throughput(runs) for name, runs in results.items()},
        "runs": {
            name: [
                {"seed": run["seed"], "reward_curve": [(s["seconds"], s["reward"]) for s in run["steps"]]}
                for run in runs
            ]
            for name, runs in results.items()
        },
    }
    if "trl" in results:
        summary["ratio_step_time"] = (
            summary["throughput"]["rlkit"]["mean_step_s"] / summary["throughput"]["trl"]["mean_step_s"]
        )
    # Learning needs natural lengths (a fixed length makes every response run past its answer), and either
    # TRL to set the level or a level given.
    summary["learning"] = None
    if not args.fixed_length and ("trl" in results or args.reward_level is not None):
        summary["learning"] = learning(results, args.reward_level, min(5, args.steps))

    if args.json:
        print(json.dumps(summary, indent=2, default=float))
        return
    print(
        f"\n{args.steps} GRPO steps, {args.prompts} prompts x {args.group} samples, {args.model}, seeds {seeds}"
    )
    print("\nrlkit phases")
    print(rlkit_table(results["rlkit"]))
    print()
    print(throughput_table(summary))
    if summary["learning"] is not None:
        print()
        print(learning_table(summary["learning"]))
        print("\nreward vs seconds")
        for name, runs in summary["runs"].items():
            for run in runs:
                curve = " ".join(f"{t:.0f}s:{r:.2f}" for t, r in run["reward_curve"] if r is not None)
                print(f"  {name:<6} seed {run['seed']}: {curve}")
    elif args.fixed_length:
        print("\nno learning table: --fixed-length runs every response past its answer; run without it")


if __name__ == "__main__":
    main()
