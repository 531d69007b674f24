"""SFT then RL against RL alone at equal wall time, on the CPU quickstart task, over seeds.

For each seed, three arms by rlkit's own entry points, one after the other:

    sft      python -m rlkit.sft +recipe=sft_quickstart sft.generation_eval=true        (the worked solutions)
    sft+rl   python -m rlkit.train +recipe=quickstart model.path=<sft's final checkpoint>
    rl       python -m rlkit.train +recipe=quickstart trainer.steps=<many>, stopped at its first evaluation at
             or past the time sft and sft+rl took together (so RL alone gets at least as much wall time)

Every arm evaluates the same held-out problems the same way (pass@1 at the training temperature over
`rollout.eval_group_size` samples, the rollout side's evaluation). The clock of an evaluation is the seconds since
its command started (start-up included), read by watching the run's metrics.jsonl; sft+rl's clock starts where
sft's ended.

    python scripts/sft_then_rl.py --out /tmp/sft-rl --seeds 0 1 2
    python scripts/sft_then_rl.py --out /tmp/sft-rl --seeds 0 --sft-steps 4 --rl-steps 2   (a smoke run)

Writes `<out>/summary.json` (every evaluation of every arm and seed; per arm the mean and standard error over
seeds of pass@1 before and at the end) and `<out>/curves.png` (pass@1 against wall minutes), and prints a
Markdown table.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import resource
import signal
import subprocess
import sys
import time
from pathlib import Path

KEY = "eval/pass@1"


def watch(cmd: list[str], metrics: Path, log: Path, *, stop_after_s: float | None = None) -> list[dict]:
    """Run `cmd`, timestamping each metrics.jsonl line holding `KEY` (seconds since the start). With
    `stop_after_s`, the run is stopped (SIGTERM to its process group, then SIGKILL) at its first evaluation at or
    past that time."""
    start = time.monotonic()
    seen, evals = 0, []
    cpu = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu0 = cpu.ru_utime + cpu.ru_stime
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        while True:
            done = proc.poll() is not None
            over = False
            if metrics.exists():
                lines = metrics.read_text().split("\n")[:-1]  # whole lines only: the last may be half written
                for line in lines[seen:]:
                    seen += 1
                    row = json.loads(line)
                    if KEY in row:
                        now = time.monotonic() - start
                        evals.append({"step": row["step"], "seconds": now, KEY: row[KEY]})
                        over = stop_after_s is not None and now >= stop_after_s
                        if over:
                            break
            if done:
                break
            if over:
                os.killpg(proc.pid, signal.SIGTERM)
                try:
                    proc.wait(timeout=120)
                except subprocess.TimeoutExpired:
                    os.killpg(proc.pid, signal.SIGKILL)
                    proc.wait()
                return _with_cpu(evals, cpu0)
            time.sleep(0.5)
    if proc.returncode != 0:
        sys.exit(f"{' '.join(cmd)} failed with exit code {proc.returncode}: see {log}")
    return _with_cpu(evals, cpu0)


def _with_cpu(evals: list[dict], cpu0: float) -> list[dict]:
    """The command's CPU seconds (its reaped processes', user + system) on its last evaluation: a second
    reading of its cost, less sensitive than wall time to what else the machine runs."""
    cpu = resource.getrusage(resource.RUSAGE_CHILDREN)
    evals[-1]["cpu_seconds"] = cpu.ru_utime + cpu.ru_stime - cpu0
    return evals


def mean_se(values: list[float]) -> tuple[float, float]:
    m = sum(values) / len(values)
    if len(values) < 2:
        return m, float("nan")
    var = sum((v - m) ** 2 for v in values) / (len(values) - 1)
    return m, math.sqrt(var / len(values))


def run_seed(seed: int, out: Path, args) -> dict[str, list[dict]]:
    py = [sys.executable, "-m"]
    common = [f"trainer.seed={seed}", "logger.backend=none"]
    sft_dir, sftrl_dir, rl_dir = (out / f"{arm}-seed{seed}" for arm in ("sft", "sftrl", "rl"))
    sft_cmd = [*py, "rlkit.sft", "+recipe=sft_quickstart", "sft.generation_eval=true", *common]
    sft_cmd += [f"trainer.run_dir={sft_dir}", f"trainer.eval_every={args.sft_eval_every}"]
    if args.sft_steps:
        sft_cmd += ["sft.epochs=null", f"trainer.steps={args.sft_steps}"]
        sft_cmd += [f"trainer.warmup_steps={min(5, args.sft_steps - 1)}"]
    sft = watch(sft_cmd, sft_dir / "metrics.jsonl", out / f"sft-seed{seed}.log")
    ckpts = sorted((sft_dir / "checkpoints").glob("step_*"), key=lambda p: int(p.name.split("_")[1]))
    rl_common = [*py, "rlkit.train", "+recipe=quickstart", *common, "trainer.save_every=0"]
    sftrl = watch(
        [*rl_common, f"model.path={ckpts[-1] / 'model'}", f"trainer.run_dir={sftrl_dir}",
         f"trainer.steps={args.rl_steps}"],
        sftrl_dir / "metrics.jsonl", out / f"sftrl-seed{seed}.log",
    )  # fmt: skip
    sft_end = sft[-1]["seconds"]
    for e in sftrl:
        e["seconds"] += sft_end
    budget = sftrl[-1]["seconds"]
    rl = watch(
        [*rl_common, f"trainer.run_dir={rl_dir}", f"trainer.steps={args.rl_max_steps}"],
        rl_dir / "metrics.jsonl", out / f"rl-seed{seed}.log", stop_after_s=budget,
    )  # fmt: skip
    return {"sft": sft, "sft+rl": sftrl, "rl": rl}


def summarize(runs: dict[int, dict[str, list[dict]]]) -> dict:
    arms = {}
    for arm in ("sft", "sft+rl", "rl"):
        start = [r[arm][0][KEY] for r in runs.values()]
        end = [r[arm][-1][KEY] for r in runs.values()]
        minutes = [r[arm][-1]["seconds"] / 60 for r in runs.values()]
        cpu = [
            (r[arm][-1]["cpu_seconds"] + (r["sft"][-1]["cpu_seconds"] if arm == "sft+rl" else 0)) / 60
            for r in runs.values()
        ]  # sft+rl's CPU includes its SFT's
        arms[arm] = {
            "first": mean_se(start), "last": mean_se(end), "minutes": mean_se(minutes), "cpu_minutes": mean_se(cpu)
        }  # fmt: skip
    return arms


def plot(runs: dict[int, dict[str, list[dict]]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    colors = {"sft": "C0", "sft+rl": "C1", "rl": "C2"}
    for seed, arms in runs.items():
        for arm, evals in arms.items():
            label = arm if seed == min(runs) else None
            x = [e["seconds"] / 60 for e in evals]
            ax.plot(x, [e[KEY] for e in evals], color=colors[arm], marker="o", markersize=3, label=label)
    ax.set_xlabel("wall minutes since the seed's first command started")
    ax.set_ylabel(f"held-out {KEY}")
    ax.grid(alpha=0.3)
    ax.legend()
    ax.set_title(f"SFT then RL against RL alone, seeds {sorted(runs)}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True, type=Path)
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--sft-steps", type=int, default=0, help="0: the recipe's one epoch")
    p.add_argument("--sft-eval-every", type=int, default=21)
    p.add_argument("--rl-steps", type=int, default=25)
    p.add_argument("--rl-max-steps", type=int, default=200, help="RL alone's steps if not stopped on time")
    args = p.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    runs = {}
    for seed in args.seeds:
        runs[seed] = run_seed(seed, args.out, args)
        (args.out / "summary.json").write_text(json.dumps({"runs": runs}, indent=1))
    arms = summarize(runs)
    (args.out / "summary.json").write_text(json.dumps({"runs": runs, "arms": arms}, indent=1))
    plot(runs, args.out / "curves.png")
    print(
        "| arm | pass@1 at its first evaluation | pass@1 at its end | wall minutes at its end | CPU minutes |"
    )
    print("|---|---|---|---|---|")
    for arm, s in arms.items():
        (a, sa), (b, sb), (m, sm), (c, sc) = s["first"], s["last"], s["minutes"], s["cpu_minutes"]
        print(
            f"| {arm} | {a:.3f} ± {sa:.3f} | {b:.3f} ± {sb:.3f} | {m:.1f} ± {sm:.1f} | {c:.1f} ± {sc:.1f} |"
        )
    print(args.out / "curves.png")


if __name__ == "__main__":
    main()
