"""scripts/see_study.py without its runs: the commands it starts, and the summary it reads back from the runs'
metrics.jsonl (the means and standard errors worked out here by hand), and its PNG."""

import json
import math
import sys

import pytest

from rlkit.config.schema import REPO_ROOT

sys.path.insert(0, str(REPO_ROOT / "scripts"))
import see_study  # noqa: E402


def write_metrics(run_dir, rows):
    run_dir.mkdir(parents=True)
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))


def fake_seed(folder, untrained, warm, rl):
    """A warm-up run evaluated at steps 0 and 4 (with training lines between), an RL run at steps 0, 2, 4."""
    sft = [
        {"step": 0, "eval/pass@1": untrained}, {"step": 2, "loss": 1.0}, {"step": 4, "loss": 0.5, "eval/pass@1": warm},
    ]  # fmt: skip
    grpo = [{"step": s, "eval/pass@1": v, "reward/mean": 0.1} for s, v in zip((0, 2, 4), rl)]
    write_metrics(folder / "sft", sft)
    write_metrics(folder / "grpo", grpo)
    return see_study.seed_summary(folder / "sft", folder / "grpo")


def test_summary_per_seed_and_across_seeds(tmp_path):
    a = fake_seed(tmp_path / "a", 0.25, 0.5, [0.5, 0.6, 0.75])
    b = fake_seed(tmp_path / "b", 0.0, 0.25, [0.25, 0.5, 0.75])
    assert a["untrained"] == 0.25 and a["after_warmup"] == 0.5 and a["final"] == 0.75
    assert a["rl_curve"] == [(0, 0.5), (2, 0.6), (4, 0.75)] and a["warmup_steps"] == 4
    summary = see_study.summarise({0: a, 1: b})
    across = summary["across_seeds"]
    # two values x, y: mean (x+y)/2, sample sd |x-y|/sqrt(2), standard error sd/sqrt(2) = |x-y|/2
    assert across["untrained"]["mean"] == pytest.approx(0.125)
    assert across["untrained"]["se"] == pytest.approx(0.125)
    assert across["after_warmup"]["mean"] == pytest.approx(0.375)
    assert across["final"] == {"mean": pytest.approx(0.75), "se": pytest.approx(0.0), "n": 2}
    assert [step for step, _ in across["rl_curve"]] == [0, 2, 4]
    assert across["rl_curve"][1][1]["mean"] == pytest.approx(0.55)
    assert across["rl_curve"][1][1]["se"] == pytest.approx(0.05)
    assert across["rl_gain"]["mean"] == pytest.approx((0.25 + 0.5) / 2)
    assert across["warmup_gain"]["mean"] == pytest.approx(0.25) and across["warmup_gain"]["se"] == 0
    json.dumps(summary)  # what main writes
    png = see_study.plot(summary, tmp_path / "curve.png")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_three_values_standard_error():
    got = see_study.mean_se([0.0, 0.5, 1.0])
    assert got["mean"] == pytest.approx(0.5) and got["se"] == pytest.approx(math.sqrt(0.25 / 3))


def test_a_warmup_without_its_step_0_evaluation_is_refused(tmp_path):
    write_metrics(tmp_path / "sft", [{"step": 4, "eval/pass@1": 0.5}])
    write_metrics(tmp_path / "grpo", [{"step": 0, "eval/pass@1": 0.5}])
    with pytest.raises(ValueError, match="step 0"):
        see_study.seed_summary(tmp_path / "sft", tmp_path / "grpo")


def test_commands_run_the_real_entry_points_with_the_recipes(tmp_path):
    ckpt = tmp_path / "sft" / "checkpoints"
    for k in (2, 10):
        (ckpt / f"step_{k}" / "model").mkdir(parents=True)
    assert see_study.final_model(tmp_path / "sft") == ckpt / "step_10" / "model"  # numeric, not text, order
    args = see_study.argparse.Namespace(
        sft_steps=3, rl_steps=None, eval_every=1, overrides=["data.num_train=64"]
    )
    sft = see_study.sft_command(tmp_path / "sft", 2, args)
    assert sft[1:4] == ["-m", "rlkit.sft", "+recipe=sft_see"]
    assert {"trainer.seed=2", "trainer.steps=3", "trainer.eval_every=1", "data.num_train=64"} <= set(sft)
    rl = see_study.rl_command(tmp_path / "grpo", ckpt / "step_10" / "model", 2, args)
    assert rl[1:4] == ["-m", "rlkit.train", "+recipe=grpo_see"] and f"model.path={ckpt}/step_10/model" in rl
    assert not any(a.startswith("trainer.steps=") for a in rl)  # the recipe's own
