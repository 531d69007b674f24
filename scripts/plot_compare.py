"""Compare runs: `python scripts/plot_compare.py --out FILE LABEL=RUN.jsonl,RUN.jsonl ... [--key eval/pass@1]`.

Draws the key of every run against the step and against wall minutes (thin lines), with each label's mean
over its runs (thick), and prints the key per step for every run and the label's mean as a Markdown table.
"""

import argparse

from rlkit.plots import elapsed_minutes, plot_comparison, read_metrics, series


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("groups", nargs="+", help="LABEL=path,path,... (metrics.jsonl files)")
    p.add_argument("--out", required=True, help="PNG path")
    p.add_argument("--key", default="eval/pass@1")
    p.add_argument("--title", default="")
    args = p.parse_args()
    groups = {}
    for g in args.groups:
        label, _, paths = g.partition("=")
        groups[label] = paths.split(",")
    plot_comparison(groups, args.out, key=args.key, title=args.title)
    steps = sorted(
        {s for paths in groups.values() for path in paths for s in series(read_metrics(path), args.key)[0]}
    )
    print("| run | " + " | ".join(f"step {s}" for s in steps) + " | wall minutes |")
    print("|---" * (len(steps) + 2) + "|")
    for label, paths in groups.items():
        table = []
        for path in paths:
            rows = read_metrics(path)
            values = dict(zip(*series(rows, args.key)))
            table.append(values)
            cells = " | ".join(f"{values[s]:.3f}" if s in values else "" for s in steps)
            print(f"| {label} {path} | {cells} | {elapsed_minutes(rows)[-1]:.1f} |")
        means = [[t[s] for t in table if s in t] for s in steps]
        cells = " | ".join(f"**{sum(m) / len(m):.3f}**" if len(m) == len(table) else "" for m in means)
        print(f"| {label} mean | {cells} | |")
    print(args.out)


if __name__ == "__main__":
    main()
