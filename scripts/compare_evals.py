"""Compare two `python -m rlkit.eval` results on the same prompts: did B do better than A, with error bars.

    python scripts/compare_evals.py A/eval.json B/eval.json                  # pass@1, total and per task
    python scripts/compare_evals.py A/eval.json B/eval.json --metric maj@4 --json diff.json

For each prompt (paired by its position and checked to be the same prompt text) the metric is averaged over
each file's seeds; the difference B - A is the mean of the per-prompt differences, and its standard error
is theirs, std(B_p - A_p) / sqrt(#prompts) (paired: a prompt that is hard for A is hard for B too, so the
paired error is smaller than the two separate errors combined, which are printed beside it). The math is
rlkit/algos/evaluation.py's.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

import torch

from rlkit.algos.evaluation import maj_at_k, paired_difference, pass_at_k, stderr


def prompt_values(report: dict, metric: str) -> tuple[list[str], list[str | None], torch.Tensor]:
    """(prompt texts, tasks, [P] the metric of each prompt averaged over the report's seeds)."""
    seeds = report["per_seed"]
    values = []
    for s in seeds:
        prompts = s["prompts"]
        if metric.startswith("pass@"):
            v = pass_at_k([p["n"] for p in prompts], [p["num_correct"] for p in prompts], int(metric[5:]))
        elif metric.startswith("maj@"):
            v = maj_at_k([p["answers"] for p in prompts], [p["correct"] for p in prompts], int(metric[4:]))
        elif metric == "reward":
            v = torch.tensor([sum(p["rewards"]) / p["n"] for p in prompts], dtype=torch.float64)
        else:
            raise SystemExit(f"--metric {metric!r}: use pass@<k>, maj@<k> or reward")
        values.append(v)
    first = seeds[0]["prompts"]
    return [p["prompt"] for p in first], [p["task"] for p in first], sum(values) / len(values)


def compare(a: dict, b: dict, metric: str = "pass@1") -> dict:
    """{task: {a, b, a_stderr, b_stderr, diff, diff_stderr, prompts}} and "total", for prompts paired in order."""
    texts_a, tasks, va = prompt_values(a, metric)
    texts_b, _, vb = prompt_values(b, metric)
    if texts_a != texts_b:
        differ = (
            next(i for i, (x, y) in enumerate(zip(texts_a, texts_b)) if x != y)
            if len(texts_a) == len(texts_b)
            else None
        )
        raise SystemExit(
            f"the two evaluations are not on the same prompts ({len(texts_a)} vs {len(texts_b)} prompts"
            + (f"; prompt {differ} differs" if differ is not None else "")
            + "): evaluate both with the same data.* settings"
        )
    groups = {"total": list(range(len(tasks)))}
    for i, t in enumerate(tasks):
        if t is not None:
            groups.setdefault(t, []).append(i)
    out = {}
    for name, idx in groups.items():
        x, y = va[idx], vb[idx]
        diff, diff_se = paired_difference(x, y)
        out[name] = {
            "prompts": len(idx), "a": float(x.mean()), "a_stderr": stderr(x), "b": float(y.mean()),
            "b_stderr": stderr(y), "diff": diff, "diff_stderr": diff_se,
        }  # fmt: skip
    return out


def _pm(v: float, se: float) -> str:
    return f"{v:+.3f} ± {se:.3f}" if not math.isnan(se) else f"{v:+.3f}"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("a", type=Path, help="eval.json of the baseline")
    parser.add_argument("b", type=Path, help="eval.json of the candidate")
    parser.add_argument("--metric", default="pass@1", help="pass@<k> | maj@<k> | reward (default pass@1)")
    parser.add_argument("--json", type=Path, help="also write the comparison to this file")
    args = parser.parse_args(argv)
    a, b = (json.loads(p.read_text()) for p in (args.a, args.b))
    result = compare(a, b, args.metric)
    print(
        f"A: {a['model'].get('path')}\nB: {b['model'].get('path')}\n{args.metric}, B - A (paired standard error):"
    )
    names = [t for t in result if t != "total"] + ["total"]
    width = max(len(t) for t in names)
    for t in names:
        r = result[t]
        print(
            f"  {t.ljust(width)}  {r['prompts']:4d} prompts  A {r['a']:.3f} ± {r['a_stderr']:.3f}  "
            f"B {r['b']:.3f} ± {r['b_stderr']:.3f}  B - A {_pm(r['diff'], r['diff_stderr'])}"
        )
    if args.json:
        args.json.write_text(
            json.dumps({"metric": args.metric, "a": str(args.a), "b": str(args.b), **result}, indent=1)
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
