"""Curves a person can read without W&B: `<run_dir>/metrics.jsonl` -> `<run_dir>/curves.png`.

The trainer calls `plot_run(run_dir)` at the end of every run; `scripts/plot_run.py RUN_DIR` redraws.
"""

from __future__ import annotations

import json
import logging
import math
import re
from pathlib import Path

from rlkit.rundir import open_own

log = logging.getLogger(__name__)

# One panel per entry: (title, metric keys drawn in it). Keys missing from a run are skipped, and a
# panel with no data left is dropped, so the same layout serves GRPO, PPO and eval-less runs.
PANELS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("reward", ("reward/mean", "reward/max")),
    ("accuracy", ("accuracy", "eval/pass@1")),
    ("dynamic sampling: share of groups kept", ("dynamic/kept_frac",)),
    ("response length (tokens)", ("response_length/mean", "response_length/max")),
    ("KL to reference", ("rollout/kl", "kl_ref")),
    ("train / rollout mismatch", ("mismatch/kl", "mismatch/k3_kl", "rollout_kl")),
    ("tool calls per episode", ("env/tool_calls", "eval/tool_calls")),
    ("seconds per step", ("timing/step_s",)),
)


# Panels drawn only when some value is non-zero (every run logs tool calls, 0 without a tool).
ZERO_MEANS_ABSENT = {"tool calls per episode"}


def read_metrics(path: str | Path) -> list[dict]:
    """The rows of a metrics JSONL file (one JSON object per line; blank or torn last lines skipped)."""
    rows = []
    for line in Path(path).read_text().splitlines():
        line = line.strip()
        if not line:
            continue
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            # A run killed mid-write leaves a torn last line; everything before it is still good.
            continue
    return rows


def series(rows: list[dict], key: str, x_key: str = "step") -> tuple[list[float], list[float]]:
    """(x, y) of `key` over the rows that have it as a finite number."""
    xs, ys = [], []
    for i, row in enumerate(rows):
        v = row.get(key)
        if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v):
            xs.append(row.get(x_key, i))
            ys.append(float(v))
    return xs, ys


def plot_finished_run(run_dir: str | Path) -> None:
    """`plot_run` at the end of a run: a plotting problem is logged, never raised (the run is done)."""
    try:
        out = plot_run(run_dir)
    except Exception as e:
        log.warning("could not draw the run's curves: %s: %s", type(e).__name__, e)
        return
    if out is not None:
        log.info("curves: %s", out)


def plot_run(run_dir: str | Path, out: str | Path | None = None) -> Path | None:
    """Draw `<run_dir>/metrics.jsonl` into a PNG (default `<run_dir>/curves.png`); None if no data."""
    import matplotlib

    matplotlib.use("Agg")  # no display needed; safe in a training process
    import matplotlib.pyplot as plt

    run_dir = Path(run_dir)
    rows = read_metrics(run_dir / "metrics.jsonl")
    # pass@k keys depend on rollout.eval_group_size: draw whichever the run logged.
    pass_at = sorted(
        {k for row in rows for k in row if re.fullmatch(r"eval/pass@\d+", k) and k != "eval/pass@1"}
    )
    panels = []
    for title, keys in PANELS:
        if title == "accuracy":
            keys = keys + tuple(pass_at)
        lines = [(k, *series(rows, k)) for k in keys]
        lines = [(k, x, y) for k, x, y in lines if x]
        if title in ZERO_MEANS_ABSENT and not any(v for _, _, y in lines for v in y):
            continue
        if lines:
            panels.append((title, lines))
    if not panels:
        return None
    cols = 2 if len(panels) > 1 else 1
    nrows = math.ceil(len(panels) / cols)
    fig, axes = plt.subplots(nrows, cols, figsize=(6 * cols, 3.2 * nrows), squeeze=False)
    for ax, (title, lines) in zip(axes.flat, panels):
        for key, x, y in lines:
            ax.plot(x, y, marker="o" if len(x) < 30 else None, markersize=3, label=key)
        ax.set_title(title)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    for ax in list(axes.flat)[len(panels) :]:
        ax.axis("off")
    fig.suptitle(run_dir.name)
    fig.tight_layout()
    if out is None:  # the run directory's own file: never written through a symlink
        out = run_dir / "curves.png"
        with open_own(out, "wb") as f:
            fig.savefig(f, dpi=110, format="png")
    else:
        out = Path(out)
        fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def elapsed_minutes(rows: list[dict]) -> list[float]:
    """Wall minutes since the run's start at the end of each row: the running sum of the step's, the
    evaluation's and the checkpoint's seconds (`timing/step_s`, `timing/eval_s`, `timing/checkpoint_s`)."""
    total, out = 0.0, []
    for row in rows:
        total += sum(
            float(row.get(k) or 0.0) for k in ("timing/step_s", "timing/eval_s", "timing/checkpoint_s")
        )
        out.append(total / 60)
    return out


def plot_comparison(
    groups: dict[str, list[str | Path]], out: str | Path, *, key: str = "eval/pass@1", title: str = ""
) -> Path:
    """`key` of several runs per label (e.g. seeds) against the step and against wall minutes: one thin line
    per run, the label's mean over its runs as a thick line (drawn where every run has the step)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (by_step, by_time) = plt.subplots(1, 2, figsize=(12, 4))
    for i, (label, paths) in enumerate(groups.items()):
        color = f"C{i}"
        per_step: dict[int, list[float]] = {}
        for path in paths:
            rows = read_metrics(path)
            for row, minutes in zip(rows, elapsed_minutes(rows)):
                row["_minutes"] = minutes
            steps, values = series(rows, key)
            minutes, _ = series(rows, key, x_key="_minutes")
            by_step.plot(steps, values, color=color, alpha=0.35, linewidth=1)
            by_time.plot(minutes, values, color=color, alpha=0.35, linewidth=1, marker="o", markersize=2)
            for s, v in zip(steps, values):
                per_step.setdefault(s, []).append(v)
        full = sorted(s for s, v in per_step.items() if len(v) == len(paths))
        mean = [sum(per_step[s]) / len(per_step[s]) for s in full]
        by_step.plot(
            full, mean, color=color, linewidth=2.5, marker="o", label=f"{label} (mean of {len(paths)})"
        )
    for ax, xlabel in ((by_step, "step"), (by_time, "wall minutes")):
        ax.set_xlabel(xlabel)
        ax.set_ylabel(key)
        ax.grid(alpha=0.3)
    by_step.legend(fontsize=8)
    fig.suptitle(title)
    fig.tight_layout()
    out = Path(out)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out
