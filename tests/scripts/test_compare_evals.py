"""scripts/compare_evals.py on two hand-made eval.json files: the paired difference worked out by hand."""

import importlib.util
import json
import math

import pytest

from rlkit.config.schema import REPO_ROOT

spec = importlib.util.spec_from_file_location("compare_evals", REPO_ROOT / "scripts" / "compare_evals.py")
compare_evals = importlib.util.module_from_spec(spec)
spec.loader.exec_module(compare_evals)


def _report(counts_by_seed, n=4):
    tasks = ["a", "a", "b", "b"]
    return {
        "model": {"path": "m"},
        "per_seed": [
            {
                "seed": s,
                "prompts": [
                    {
                        "index": i,
                        "prompt": f"q{i}",
                        "task": tasks[i],
                        "n": n,
                        "num_correct": c,
                        "correct": [j < c for j in range(n)],
                        "answers": ["x"] * n,
                        "rewards": [float(j < c) for j in range(n)],
                    }
                    for i, c in enumerate(counts)
                ],
            }  # fmt: skip
            for s, counts in enumerate(counts_by_seed)
        ],
    }


def test_paired_difference_of_pass_at_1_by_hand(tmp_path, capsys):
    a = _report([[0, 1, 2, 4]])
    b = _report([[1, 1, 4, 4], [3, 1, 4, 4]])  # two seeds: per-prompt means 2/4, 1/4, 1, 1
    (tmp_path / "a.json").write_text(json.dumps(a))
    (tmp_path / "b.json").write_text(json.dumps(b))
    assert (
        compare_evals.main(
            [str(tmp_path / "a.json"), str(tmp_path / "b.json"), "--json", str(tmp_path / "d.json")]
        )
        == 0
    )
    d = json.loads((tmp_path / "d.json").read_text())
    diffs = [0.5 - 0.0, 0.25 - 0.25, 1.0 - 0.5, 1.0 - 1.0]
    mean = sum(diffs) / 4
    se = math.sqrt(sum((x - mean) ** 2 for x in diffs) / 3) / 2
    assert d["total"]["diff"] == pytest.approx(mean) and d["total"]["diff_stderr"] == pytest.approx(se)
    assert d["total"]["a"] == pytest.approx((0 + 0.25 + 0.5 + 1) / 4)
    assert d["a"]["diff"] == pytest.approx(0.25) and d["b"]["diff"] == pytest.approx(0.25)
    assert "B - A +0.250 ± 0.144" in capsys.readouterr().out  # total: 0.25 ± sqrt(1/12) / 2


def test_different_prompts_are_refused(tmp_path):
    a, b = _report([[0, 1, 2, 4]]), _report([[0, 1, 2, 4]])
    b["per_seed"][0]["prompts"][2]["prompt"] = "another"
    (tmp_path / "a.json").write_text(json.dumps(a))
    (tmp_path / "b.json").write_text(json.dumps(b))
    with pytest.raises(SystemExit, match="prompt 2 differs"):
        compare_evals.main([str(tmp_path / "a.json"), str(tmp_path / "b.json")])
