"""A/B in one run: a command run alternately on a named commit (A) and on the working tree (B), same machine.

    python scripts/ab.py --against 8259c11 --rounds 3 -- \\
        python -m rlkit.train +recipe=quickstart trainer.run_dir={run_dir} logger=none trainer.progress_bar=false

`{round}` in the command becomes the round's number (0, 1, ...), for a seed per round
(`trainer.seed={round}`): each pair then compares both sides on the same seed.

A is a detached git worktree of the commit (made once under --workdir, the same Python environment, rlkit
imported from it through PYTHONPATH); B is this checkout as it is, uncommitted changes included. The runs go
A B A B ... (`--rounds` pairs), each in a fresh `{run_dir}`, so a machine whose speed drifts during the hour
slows both sides alike. For each run: the wall time, the load average before and after, and the means over
steps 2.. of its `metrics.jsonl` (`timing/step_s`, the phases, MFU) plus the last evaluation. The report
gives every figure for A and B and the ratio B/A of each round's pair, with its mean and spread (min, max):
a change is a regression only if the ratio is outside the spread the rounds show. `scripts/bench.py
--against REV` uses the same machinery for the GRPO benchmark.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
# Per-step keys averaged over steps 2.. (step 1 carries imports and first allocations).
STEP_KEYS = (
    "timing/step_s", "timing/generate_s", "timing/update_s", "timing/logprobs_s", "timing/weight_push_s",
    "perf/learner_mfu", "perf/gen_mfu", "learner/tokens_per_s", "perf/gen_tokens_per_s",
)  # fmt: skip
LAST_KEYS = ("eval/pass@1",)


def checkout(rev: str, workdir: Path) -> tuple[Path, str]:
    """A detached worktree of `rev` under `workdir` (reused when it is already there); (its path, full sha)."""
    sha = subprocess.run(
        ["git", "rev-parse", "--verify", f"{rev}^{{commit}}"],
        cwd=REPO,
        check=True,
        capture_output=True,
        text=True,
    ).stdout.strip()
    path = workdir / f"against-{sha[:12]}"
    if not (path / "rlkit").is_dir():
        subprocess.run(["git", "worktree", "add", "--detach", "-f", str(path), sha], cwd=REPO, check=True,
                       capture_output=True)  # fmt: skip
    return path, sha


def describe_b() -> str:
    """The working tree: HEAD's sha and whether it has uncommitted changes."""
    sha = subprocess.run(
        ["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True, text=True
    ).stdout.strip()
    dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=REPO, capture_output=True,
                           text=True).stdout.strip()  # fmt: skip
    return f"{sha[:12]}{' + uncommitted changes' if dirty else ''}"


def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return f"{line.split(':', 1)[1].strip()} ({os.cpu_count()} CPUs)"
    except OSError:
        pass
    return f"{os.cpu_count()} CPUs"


def env_for(root: Path) -> dict[str, str]:
    """The environment of a run in `root`: rlkit (and scripts/) imported from that checkout."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(root), str(root / "scripts"), env.get("PYTHONPATH", "")])
    return env


def run_one(argv: list[str], root: Path, run_dir: Path, round_: int = 0) -> dict:
    """Run `argv` (with `{run_dir}` and `{round}` substituted) in `root`; its wall time, loads and metrics."""
    cmd = [a.replace("{run_dir}", str(run_dir)).replace("{round}", str(round_)) for a in argv]
    load_before = os.getloadavg()[0]
    start = time.perf_counter()
    proc = subprocess.run(cmd, cwd=root, env=env_for(root), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                          text=True)  # fmt: skip
    wall = time.perf_counter() - start
    if proc.returncode != 0:
        raise RuntimeError(
            f"{shlex.join(cmd)} failed in {root} (rc {proc.returncode}):\n{proc.stderr[-3000:]}"
        )
    out = {"wall_s": wall, "load_before": load_before, "load_after": os.getloadavg()[0]}
    out.update(summarize_metrics(run_dir / "metrics.jsonl"))
    return out


def summarize_metrics(path: Path) -> dict[str, float]:
    """Means of `STEP_KEYS` over the training steps after the first, and the last value of `LAST_KEYS`."""
    if not path.is_file():
        return {}
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    steps = [r for r in rows if "timing/step_s" in r]
    later = steps[1:] or steps
    out = {}
    for key in STEP_KEYS:
        values = [r[key] for r in later if isinstance(r.get(key), (int, float))]
        if values:
            out[key] = sum(values) / len(values)
    for key in LAST_KEYS:
        values = [r[key] for r in rows if isinstance(r.get(key), (int, float))]
        if values:
            out[key] = values[-1]
    return out


def compare(a_runs: list[dict], b_runs: list[dict]) -> dict[str, dict]:
    """Per figure: A's and B's values per round, and the ratio B/A of each round's pair with mean, min, max."""
    table = {}
    keys = [k for k in a_runs[0] if k in b_runs[0] and not k.startswith("load_")]
    for key in keys:
        a = [r[key] for r in a_runs]
        b = [r[key] for r in b_runs]
        ratios = [y / x for x, y in zip(a, b) if x]
        table[key] = {
            "A": a, "B": b, "A_mean": statistics.fmean(a), "B_mean": statistics.fmean(b),
            "ratio_mean": statistics.fmean(ratios) if ratios else None,
            "ratio_min": min(ratios) if ratios else None, "ratio_max": max(ratios) if ratios else None,
        }  # fmt: skip
    return table


def report(result: dict) -> str:
    lines = [
        f"A = {result['against']} (worktree {result['a_root']}), B = {result['b']} (this checkout)",
        f"{result['rounds']} rounds, alternating A B; {result['cpu']}; started {result['started']}",
        f"load average (1 min) before / after each run: A {result['loads']['A']}, B {result['loads']['B']}",
        "",
        f"{'figure':<26} {'A mean':>10} {'B mean':>10} {'B/A mean':>9} {'B/A min':>8} {'B/A max':>8}",
    ]
    for key, row in result["table"].items():
        r = row["ratio_mean"]
        ratio = f"{r:9.3f} {row['ratio_min']:8.3f} {row['ratio_max']:8.3f}" if r is not None else "        -"
        lines.append(f"{key:<26} {row['A_mean']:10.4g} {row['B_mean']:10.4g} {ratio}")
    return "\n".join(lines)


def alternate(rounds: int, run_a, run_b) -> tuple[list, list]:
    """`rounds` pairs, A then B each round; returns (A's results, B's results)."""
    a_runs, b_runs = [], []
    for i in range(rounds):
        a_runs.append(run_a(i))
        b_runs.append(run_b(i))
    return a_runs, b_runs


def main(argv: list[str] | None = None) -> dict:
    argv = sys.argv[1:] if argv is None else argv
    if "--" not in argv:
        raise SystemExit("usage: ab.py --against REV [--rounds N] [--workdir DIR] [--json] -- COMMAND ...")
    split = argv.index("--")
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--against", required=True, help="the commit (or branch, tag) to compare with: A")
    p.add_argument("--rounds", type=int, default=3, help="A B pairs (default 3)")
    p.add_argument(
        "--workdir", default=None, help="where A's worktree and the run dirs go (default: a temp dir)"
    )
    p.add_argument("--json", action="store_true", help="print the result as JSON instead of a table")
    args = p.parse_args(argv[:split])
    command = argv[split + 1 :]
    if args.rounds < 1:
        raise SystemExit(f"--rounds={args.rounds} must be >= 1")
    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="rlkit-ab-")).resolve()
    workdir.mkdir(parents=True, exist_ok=True)
    a_root, sha = checkout(args.against, workdir)
    started = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    a_runs, b_runs = alternate(
        args.rounds,
        lambda i: run_one(command, a_root, workdir / f"A-{i}", i),
        lambda i: run_one(command, REPO, workdir / f"B-{i}", i),
    )
    result = {
        "against": sha[:12], "a_root": str(a_root), "b": describe_b(), "rounds": args.rounds, "cpu": cpu_name(),
        "started": started, "command": shlex.join(command),
        "loads": {
            side: [f"{r['load_before']:.1f}/{r['load_after']:.1f}" for r in runs]
            for side, runs in (("A", a_runs), ("B", b_runs))
        },
        "table": compare(a_runs, b_runs), "runs": {"A": a_runs, "B": b_runs},
    }  # fmt: skip
    print(json.dumps(result, indent=1) if args.json else report(result))
    return result


if __name__ == "__main__":
    main()
