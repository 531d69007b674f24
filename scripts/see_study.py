"""The "learns to see" study: for each seed, the supervised warm-up of smollm2-135m-vl's vision side
(`python -m rlkit.sft +recipe=sft_see`), then GRPO from its checkpoint (`python -m rlkit.train +recipe=grpo_see`),
each a real run of the entry point in its own run directory under --out; the held-out pass@1 at every evaluation
is read back from the runs' own metrics.jsonl.

    python scripts/see_study.py --out runs/see-study                       # 3 seeds, the recipes' step counts
    python scripts/see_study.py --out /tmp/see --seeds 0 --sft-steps 2 --rl-steps 2 --eval-every 1 -- \\
        data.num_train=64 data.eval_size=8                                 # a smoke run; overrides for both runs

Writes --out/summary.json: per seed the untrained model's pass@1 (the warm-up's step-0 evaluation), after the
warm-up (its last), the curve during RL ([step, pass@1] from its step-0 evaluation on) and the final value;
across seeds the mean and standard error (sample standard deviation / sqrt(seeds)) of each of those and of the
RL curve at each step; and --out/see-study.png, pass@1 against the step over both phases (one thin line per
seed, the mean with its standard error).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
KEY = "eval/pass@1"
COMMON = ("logger=none", "trainer.progress_bar=false", "trainer.curves=false")


def evals(run_dir: Path) -> list[tuple[int, float]]:
    """[(step, pass@1)] of every evaluation a run logged in its metrics.jsonl, in step order."""
    from rlkit.plots import read_metrics, series

    steps, values = series(read_metrics(run_dir / "metrics.jsonl"), KEY)
    return sorted(zip((int(s) for s in steps), values))


def final_model(run_dir: Path) -> Path:
    """The model folder of a run's newest checkpoint (`checkpoints/step_<k>/model`)."""
    ckpts = sorted((run_dir / "checkpoints").glob("step_*"), key=lambda p: int(p.name.removeprefix("step_")))
    if not ckpts:
        raise FileNotFoundError(f"{run_dir}: no checkpoint was written")
    return ckpts[-1] / "model"


def sft_command(run_dir: Path, seed: int, args) -> list[str]:
    cmd = [
        sys.executable,
        "-m",
        "rlkit.sft",
        "+recipe=sft_see",
        f"trainer.run_dir={run_dir}",
        f"trainer.seed={seed}",
    ]
    if args.sft_steps is not None:
        cmd.append(f"trainer.steps={args.sft_steps}")
    if args.eval_every is not None:
        cmd.append(f"trainer.eval_every={args.eval_every}")
    return [*cmd, *COMMON, *args.overrides]


def rl_command(run_dir: Path, model: Path, seed: int, args) -> list[str]:
    cmd = [
        sys.executable, "-m", "rlkit.train", "+recipe=grpo_see", f"model.path={model}", f"trainer.run_dir={run_dir}",
        f"trainer.seed={seed}",
    ]  # fmt: skip
    if args.rl_steps is not None:
        cmd.append(f"trainer.steps={args.rl_steps}")
    if args.eval_every is not None:
        cmd.append(f"trainer.eval_every={args.eval_every}")
    return [*cmd, *COMMON, *args.overrides]


def run(cmd: list[str], log: Path) -> float:
    """Run `cmd` from the repository root with its output in `log`; its wall seconds. A failure raises, naming
    the log."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]))
    print("$", " ".join(cmd), flush=True)
    start = time.perf_counter()
    with open(log, "w") as out:
        code = subprocess.run(cmd, cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT).returncode
    if code:
        raise RuntimeError(f"{cmd[2]} exited with {code}: see {log}")
    return time.perf_counter() - start


def mean_se(values: list[float]) -> dict[str, float | int]:
    """Mean and standard error (sample standard deviation / sqrt(n); 0 for one value) of `values`."""
    n = len(values)
    mean = sum(values) / n
    var = sum((v - mean) ** 2 for v in values) / (n - 1) if n > 1 else 0.0
    return {"mean": mean, "se": math.sqrt(var / n), "n": n}


def seed_summary(sft_dir: Path, rl_dir: Path) -> dict:
    """One seed's pass@1: untrained (the warm-up's first evaluation, at step 0), after the warm-up (its last),
    the RL curve and its final value."""
    warm, rl = evals(sft_dir), evals(rl_dir)
    if not warm or warm[0][0] != 0 or not rl:
        raise ValueError(
            f"{sft_dir} / {rl_dir}: {KEY} is missing (the warm-up must evaluate at step 0, RL at least once)"
        )
    return {
        "untrained": warm[0][1], "after_warmup": warm[-1][1], "warmup_curve": warm, "warmup_steps": warm[-1][0],
        "rl_curve": rl, "final": rl[-1][1],
    }  # fmt: skip


def summarise(seeds: dict[int, dict]) -> dict:
    """The per-seed summaries and, across seeds, the mean and standard error of each figure and of the RL curve
    at every step that all seeds evaluated."""
    per = list(seeds.values())
    across = {k: mean_se([s[k] for s in per]) for k in ("untrained", "after_warmup", "final")}
    curves = [dict(s["rl_curve"]) for s in per]
    steps = sorted(set.intersection(*(set(c) for c in curves)))
    across["rl_curve"] = [[step, mean_se([c[step] for c in curves])] for step in steps]
    across["rl_gain"] = mean_se([s["final"] - s["after_warmup"] for s in per])
    across["warmup_gain"] = mean_se([s["after_warmup"] - s["untrained"] for s in per])
    return {"key": KEY, "seeds": {str(k): v for k, v in seeds.items()}, "across_seeds": across}


def plot(summary: dict, out: Path) -> Path:
    """pass@1 against the step over both phases (RL's steps after the warm-up's): a thin line per seed, the mean
    of the seeds with its standard error as a band, a dashed line where RL starts."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    offsets = []
    for name, s in summary["seeds"].items():
        offset = s["warmup_steps"]
        offsets.append(offset)
        xs = [x for x, _ in s["warmup_curve"]] + [offset + x for x, _ in s["rl_curve"]]
        ys = [y for _, y in s["warmup_curve"]] + [y for _, y in s["rl_curve"]]
        ax.plot(xs, ys, color="C0", alpha=0.3, linewidth=1, marker="o", markersize=2, label=f"seed {name}")
    offset = max(offsets)
    curve = summary["across_seeds"]["rl_curve"]
    xs = [offset + step for step, _ in curve]
    mean = [m["mean"] for _, m in curve]
    se = [m["se"] for _, m in curve]
    ax.plot(xs, mean, color="C1", linewidth=2.5, marker="o", label="GRPO, mean of seeds")
    ax.fill_between(
        xs, [m - e for m, e in zip(mean, se)], [m + e for m, e in zip(mean, se)], color="C1", alpha=0.2
    )
    ax.axvline(offset, color="gray", linestyle="--", linewidth=1)
    ax.text(offset, ax.get_ylim()[1], " GRPO starts", va="top", fontsize=8, color="gray")
    ax.set_xlabel("step (supervised warm-up of the vision side, then GRPO)")
    ax.set_ylabel(f"held-out {KEY}")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True, help="folder of the run directories, summary.json and the PNG")
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--sft-steps", type=int, default=None, help="warm-up steps (default: sft_see's)")
    ap.add_argument("--rl-steps", type=int, default=None, help="GRPO steps (default: grpo_see's)")
    ap.add_argument("--eval-every", type=int, default=None, help="evaluation period of both runs")
    ap.add_argument("overrides", nargs="*", help="Hydra overrides for both runs (after --)")
    args = ap.parse_args(argv)
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    seeds, seconds = {}, {}
    for seed in args.seeds:
        folder = out / f"seed{seed}"
        folder.mkdir(exist_ok=True)
        sft_dir, rl_dir = folder / "sft", folder / "grpo"
        t_sft = run(sft_command(sft_dir, seed, args), folder / "sft.log")
        t_rl = run(rl_command(rl_dir, final_model(sft_dir), seed, args), folder / "grpo.log")
        seeds[seed] = seed_summary(sft_dir, rl_dir)
        seconds[seed] = {"warmup": round(t_sft, 1), "grpo": round(t_rl, 1)}
        print(
            json.dumps({"seed": seed, **{k: seeds[seed][k] for k in ("untrained", "after_warmup", "final")}})
        )
    summary = summarise(seeds) | {"wall_seconds": {str(k): v for k, v in seconds.items()}}
    summary["command"] = " ".join([Path(sys.argv[0]).name, *(argv if argv is not None else sys.argv[1:])])
    (out / "summary.json").write_text(json.dumps(summary, indent=2))
    plot(summary, out / "see-study.png")
    print(json.dumps(summary["across_seeds"], indent=2))
    return summary


if __name__ == "__main__":
    main()
