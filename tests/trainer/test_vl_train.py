"""A whole training run on a vision-language model (the tiny Qwen2.5-VL of tests/vl_families.py with its
processor) on the HF engine, over a small image dataset written into tmp_path (PNG files named in JSONL rows):
2 steps in this process, the engine and learner agreeing on every prompt with its image, samples.jsonl naming
each sample's image; then `rlkit.eval` on the VL checkpoint."""

import json

import pytest
from run_helpers import read_jsonl, run_args
from vl_families import VL_FAMILIES, build_vl_family, picture

from rlkit.eval import main_from_config
from rlkit.models import is_vision_language
from rlkit.train import compose
from rlkit.vision import load_processor

pytestmark = pytest.mark.slow  # trainer runs

COLOURS = {"red": (255, 0, 0), "green": (0, 255, 0), "blue": (0, 0, 255), "white": (255, 255, 255)}


def image_dataset(folder):
    """train.jsonl / test.jsonl: "What colour is this picture?" over one-colour PNGs (the answer is the colour)."""
    folder.mkdir()
    rows = []
    for name, rgb in COLOURS.items():
        for size in ((56, 56), (84, 56)):
            path = folder / f"{name}-{size[0]}.png"
            picture(rgb, size=size).save(path)
            rows.append({"question": "What colour is this picture?", "answer": name, "image": str(path)})
    (folder / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (folder / "test.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows[:4]))
    return folder


def args(ckpt, data, run_dir, *extra):
    return [
        "+recipe=quickstart_1digit", f"model.path={ckpt}", f"trainer.run_dir={run_dir}", "trainer.steps=2",
        "trainer.train_batch_size=4", "rollout.group_size=2", "rollout.max_new_tokens=6", "data.eval_size=4",
        f"data.path={data}", "data.subset=null", "data.image_key=image", "data.max_prompt_tokens=128",
        "trainer.eval_every=0", "trainer.save_every=0", "trainer.lr=1e-3", "trainer.progress_bar=false",
        "trainer.curves=false", "reward.fn=rlkit_test_rewards:length", "reward.num_workers=1",
        "algo.mask_zero_std_groups=false", "logger=none", "rollout.engine=hf", "trainer.eval_at_start=false",
        "trainer.log_samples=4", "rollout.weight_sync_kl_threshold=1e-3", "model.dtype=float32",
        *extra,
    ]  # fmt: skip


@pytest.mark.parametrize("family", sorted(VL_FAMILIES))
def test_a_vl_model_trains_on_images_with_the_hf_engine(tmp_path, family):
    ckpt = build_vl_family(family, tmp_path / family)
    data = image_dataset(tmp_path / "colours")
    run_dir = tmp_path / "run"
    run_args(args(ckpt, data, run_dir, "trainer.save_every=2"))
    steps = [m for m in read_jsonl(run_dir / "metrics.jsonl") if "reward/mean" in m]
    assert [m["step"] for m in steps] == [1, 2] and steps[0]["grad_norm"] > 0
    for m in steps:  # the engine's log-probs are the learner's on prompts with images (fp32)
        assert abs(m["mismatch/kl"]) < 1e-5 and m["mismatch/logprob_abs_diff"] < 1e-4
    saved = run_dir / "checkpoints" / "step_2" / "model"  # loads as a VL model with its processor
    assert is_vision_language(saved) and load_processor(saved).image_processor is not None
    samples = read_jsonl(run_dir / "samples.jsonl")
    assert samples and all(len(s["image"]) == 64 for s in samples)  # each sample names its image (sha256)
    # Train rows show the expanded prompt (the family's first image token), eval rows the template's text (its
    # placeholder for the picture).
    tokens, placeholder, _ = VL_FAMILIES[family]
    assert all(tokens[0] in s["prompt"] for s in samples if s["kind"] == "train")
    assert all(placeholder in s["prompt"] for s in samples if s["kind"] == "eval")


def test_rlkit_eval_evaluates_a_vl_checkpoint(tmp_path):
    ckpt = build_vl_family("qwen2.5-vl", tmp_path / "qwen25vl")
    data = image_dataset(tmp_path / "colours")
    out = tmp_path / "eval.json"
    cfg = compose(args(ckpt, data, tmp_path / "unused", f"eval.model={ckpt}", "rollout.eval_group_size=2",
                       "eval.ks=[1,2]", "rollout.eval_temperature=1.0"))  # fmt: skip
    report = main_from_config(cfg, out)
    assert report["settings"]["prompts"] == 4 and report["settings"]["engine"] == "hf"
    prompts = report["per_seed"][0]["prompts"]
    assert all(len(p["image"]) == 64 and "<|image_pad|>" in p["prompt"] for p in prompts)
    assert len({p["image"] for p in prompts}) == 4  # four different pictures, four digests
    assert json.loads(out.read_text())["metrics"]["total"]["prompts"] == 4
