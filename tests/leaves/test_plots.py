"""Run curves: metrics.jsonl -> PNG, and the plot_run.py script."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from rlkit.plots import plot_run, read_metrics, series

REPO = Path(__file__).resolve().parents[2]


def write_run(run_dir: Path) -> None:
    rows = [
        {"step": 0, "eval/pass@1": 0.1, "eval/pass@4": 0.3},
        {"step": 1, "reward/mean": 0.0, "response_length/mean": 40.0, "mismatch/kl": 1e-7},
        {"step": 2, "reward/mean": 0.5, "response_length/mean": 30.0, "mismatch/kl": "nan"},
        {"step": 3, "reward/mean": 0.75, "eval/pass@1": 0.6, "eval/pass@4": 0.9},
    ]
    run_dir.mkdir(parents=True, exist_ok=True)
    text = "".join(json.dumps(r) + "\n" for r in rows) + '{"step": 4, "reward/me'  # torn last line
    (run_dir / "metrics.jsonl").write_text(text)


def test_series_skips_missing_non_numeric_and_torn_rows(tmp_path):
    write_run(tmp_path)
    rows = read_metrics(tmp_path / "metrics.jsonl")
    assert len(rows) == 4  # the torn line is dropped
    assert series(rows, "reward/mean") == ([1, 2, 3], [0.0, 0.5, 0.75])
    assert series(rows, "eval/pass@1") == ([0, 3], [0.1, 0.6])
    assert series(rows, "mismatch/kl") == ([1], [1e-7])  # the "nan" string is not a number
    assert series(rows, "absent") == ([], [])


def test_plot_run_writes_a_png_and_the_script_redraws_it(tmp_path):
    write_run(tmp_path)
    out = plot_run(tmp_path)
    assert out == tmp_path / "curves.png"
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    other = tmp_path / "again.png"
    proc = subprocess.run(
        [sys.executable, str(REPO / "scripts" / "plot_run.py"), str(tmp_path), "--out", str(other)],
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 0, proc.stderr
    assert other.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def _titles(tmp_path, monkeypatch, row: dict) -> list[str]:
    """The panel titles plot_run draws for a one-row metrics.jsonl."""
    import matplotlib.axes

    titles = []
    monkeypatch.setattr(matplotlib.axes.Axes, "set_title", lambda self, t, *a, **k: titles.append(t))
    (tmp_path / "metrics.jsonl").write_text(json.dumps({"step": 1, "reward/mean": 0.5, **row}))
    plot_run(tmp_path)
    return titles


def test_tool_call_panel_only_when_a_tool_was_called(tmp_path, monkeypatch):
    titles = _titles(tmp_path, monkeypatch, {"env/tool_calls": 0.0, "eval/tool_calls": 0.0})
    assert "reward" in titles and "tool calls per episode" not in titles  # every run logs 0 without a tool
    assert "tool calls per episode" in _titles(tmp_path, monkeypatch, {"env/tool_calls": 0.5})


def test_dynamic_sampling_panel_only_in_refill_runs(tmp_path, monkeypatch):
    panel = "dynamic sampling: share of groups kept"
    assert panel not in _titles(tmp_path, monkeypatch, {})
    assert panel in _titles(tmp_path, monkeypatch, {"dynamic/kept_frac": 0.25})


def test_plot_run_without_data_returns_none(tmp_path):
    (tmp_path / "metrics.jsonl").write_text("")
    assert plot_run(tmp_path) is None


def test_compare_script_tabulates_means_and_wall_minutes_and_draws(tmp_path):
    def run(name, values, step_s):
        rows = [{"step": 0, "eval/pass@1": values[0], "timing/eval_s": 30.0}]
        rows += [{"step": 1, "timing/step_s": step_s}, {"step": 2, "timing/step_s": step_s}]
        rows.append({"step": 2, "eval/pass@1": values[1], "timing/eval_s": 30.0, "timing/checkpoint_s": 60.0})
        path = tmp_path / f"{name}.jsonl"
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
        return str(path)

    a, b = run("a", [0.1, 0.5], 60.0), run("b", [0.2, 0.7], 120.0)
    out = tmp_path / "cmp.png"
    proc = subprocess.run(
        [sys.executable, str(REPO / "scripts/plot_compare.py"), "--out", str(out), f"x={a},{b}"],
        capture_output=True, text=True, check=True,
    )  # fmt: skip
    lines = proc.stdout.splitlines()
    # wall minutes: a = (30 + 60 + 60 + 30 + 60) s = 4.0 min, b = (30 + 120 + 120 + 30 + 60) s = 6.0 min
    assert any(line.startswith(f"| x {a} | 0.100 | 0.500 | 4.0 |") for line in lines), proc.stdout
    assert any(line.startswith(f"| x {b} | 0.200 | 0.700 | 6.0 |") for line in lines), proc.stdout
    assert "| x mean | **0.150** | **0.600** | |" in lines
    assert out.stat().st_size > 10_000 and out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
