"""Redraw a run's curves: `python scripts/plot_run.py RUN_DIR [--out FILE]` (reads RUN_DIR/metrics.jsonl)."""

import argparse

from rlkit.plots import plot_run


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("run_dir")
    p.add_argument("--out", default=None, help="PNG path (default RUN_DIR/curves.png)")
    args = p.parse_args()
    out = plot_run(args.run_dir, args.out)
    if out is None:
        raise SystemExit(f"no plottable metrics in {args.run_dir}/metrics.jsonl")
    print(out)


if __name__ == "__main__":
    main()
