"""scripts/ab.py (A/B in one run against a named commit) and bench.py's --against plumbing."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from rlkit.config.schema import REPO_ROOT

sys.path.insert(0, str(REPO_ROOT / "scripts"))
import ab  # noqa: E402
import bench  # noqa: E402


def test_compare_gives_each_rounds_ratio_and_its_spread():
    a = [{"timing/step_s": 10.0, "load_before": 1.0}, {"timing/step_s": 12.0, "load_before": 1.0}]
    b = [{"timing/step_s": 9.0, "load_before": 1.0}, {"timing/step_s": 12.0, "load_before": 1.0}]
    row = ab.compare(a, b)["timing/step_s"]
    assert row["A_mean"] == 11.0 and row["B_mean"] == 10.5
    assert row["ratio_mean"] == pytest.approx(0.95) and row["ratio_min"] == 0.9 and row["ratio_max"] == 1.0
    assert "load_before" not in ab.compare(a, b)


def test_metrics_are_averaged_over_the_steps_after_the_first(tmp_path):
    lines = [{"step": 0, "eval/pass@1": 0.1}] + [
        {"step": i, "timing/step_s": s, "perf/learner_mfu": m} for i, (s, m) in enumerate([(5, 0.1), (2, 0.4), (4, 0.6)], 1)
    ] + [{"step": 3, "eval/pass@1": 0.5}]  # fmt: skip
    path = tmp_path / "metrics.jsonl"
    path.write_text("\n".join(json.dumps(x) for x in lines))
    out = ab.summarize_metrics(path)
    assert out["timing/step_s"] == 3.0 and out["perf/learner_mfu"] == pytest.approx(0.5)
    assert out["eval/pass@1"] == 0.5


PROBE = """
import json, sys, time, pathlib, rlkit
run = pathlib.Path(sys.argv[1]); run.mkdir(parents=True)
(run / "where.txt").write_text(f"{rlkit.__file__}\\n{time.time()}\\n{sys.argv[2]}")
(run / "metrics.jsonl").write_text("\\n".join(json.dumps({"timing/step_s": v}) for v in (9.0, 1.0, 3.0)))
"""


@pytest.fixture
def workdir(tmp_path):
    yield tmp_path
    for tree in tmp_path.glob("against-*"):  # the commit's worktree: unregistered from the repository too
        subprocess.run(
            ["git", "worktree", "remove", "--force", str(tree)], cwd=REPO_ROOT, capture_output=True
        )


def test_the_runs_alternate_and_each_side_imports_its_own_checkout(workdir, capsys):
    tmp_path = workdir
    command = [sys.executable, "-c", PROBE, "{run_dir}", "seed={round}"]
    result = ab.main(["--against", "HEAD", "--rounds", "2", "--workdir", str(tmp_path), "--", *command])
    a_root = Path(result["a_root"])
    assert a_root != REPO_ROOT and (a_root / "rlkit").is_dir()
    seen = {}
    for side in ("A", "B"):
        for i in range(2):
            where, when, seed = (tmp_path / f"{side}-{i}" / "where.txt").read_text().splitlines()
            seen[side, i] = float(when)
            assert seed == f"seed={i}"  # {round} is the round's number
            root = a_root if side == "A" else REPO_ROOT
            assert Path(where).resolve().is_relative_to(root.resolve()), (side, where)
    assert seen["A", 0] < seen["B", 0] < seen["A", 1] < seen["B", 1]
    row = result["table"]["timing/step_s"]
    assert row["A"] == [2.0, 2.0] and row["ratio_mean"] == 1.0  # steps 2..: (1 + 3) / 2
    assert "timing/step_s" in capsys.readouterr().out and result["cpu"]


def test_bench_children_get_the_options_without_the_ab_ones():
    argv = ["--steps", "5", "--against", "abc123", "--rounds=2", "--fixed-length", "--rounds", "4", "--json"]
    assert bench.without_options(argv, ("--against", "--rounds")) == [
        "--steps",
        "5",
        "--fixed-length",
        "--json",
    ]


def test_bench_children_run_in_a_scratch_directory_each(tmp_path, monkeypatch):
    """Each side of each round gets its own --workdir (its trainer.run_dir), never the A/B's: a second side
    in the first one's run directory is refused as a used run directory."""
    commands = []

    def run(cmd, **kwargs):
        commands.append(cmd)
        out = Path(cmd[cmd.index("--_out") + 1])
        out.write_text("{}")

    monkeypatch.setattr(bench.subprocess, "run", run)
    args = bench.argparse.Namespace(
        argv=["--steps", "5", "--workdir", str(tmp_path), "--against", "abc", "--rounds", "2"]
    )
    for name in ("A-0", "B-0"):
        bench.child("rlkit", 0, args, tmp_path / f"{name}.json", REPO_ROOT)
    workdirs = [cmd[i + 1] for cmd in commands for i, a in enumerate(cmd) if a == "--workdir"]
    assert workdirs == [str(tmp_path / "A-0"), str(tmp_path / "B-0")]  # one each, the A/B's own left out
    assert all("--against" not in cmd and "--rounds" not in cmd for cmd in commands)


def test_bench_figures_of_a_run_leave_out_step_one():
    steps = [
        {"seconds": s, "gen_tokens": g, "gen_s": gs, "learner_tokens": lt, "learner_s": ls, "reward": 0.0,
         "metrics": {"timing/update_s": ls, "perf/learner_mfu": m}}
        for s, g, gs, lt, ls, m in [(10, 100, 5, 200, 4, 0.1), (13, 60, 1, 100, 2, 0.5), (17, 60, 2, 300, 2, 0.7)]
    ]  # fmt: skip
    fig = bench.run_figures({"framework": "rlkit", "steps": steps})
    # steps 2 and 3: 3 s and 4 s a step, 120 tokens in 3 s of generation, 400 learner tokens in 4 s
    assert (
        fig["mean_step_s"] == 3.5 and fig["gen_tokens_per_s"] == 40.0 and fig["learner_tokens_per_s"] == 100.0
    )
    assert fig["timing/update_s"] == 2.0 and fig["perf/learner_mfu"] == pytest.approx(0.6)
