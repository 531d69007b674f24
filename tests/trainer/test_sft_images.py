"""`python -m rlkit.sft` on rows with images (data.image_key): the tiny Idefics3 / SmolVLM of tests/vl_families.py
with its processor, over one-colour PNGs named in JSONL rows. The first step's loss is the token-mean NLL of the
assistant tokens that a plain transformers forward gives on the processor's own tensors (the chat text written
here by hand); model.freeze_language leaves the language model bit-identical (and model.freeze_vision the tower)
while the rest trains; the checkpoint keeps its processor, and `python -m rlkit.train` starts from it."""

import json

import pytest
import torch
from run_helpers import read_jsonl, run_args
from vl_families import build_vl_family, picture

from rlkit import sft
from rlkit.config.schema import ConfigError
from rlkit.train import compose
from rlkit.vision import load_processor

pytestmark = pytest.mark.slow  # whole SFT runs

SYSTEM = "Answer with a colour."
QUESTION = "What colour is this picture?"
COLOURS = {"red": (255, 0, 0), "green": (0, 255, 0), "blue": (0, 0, 255), "white": (255, 255, 255)}


@pytest.fixture(scope="module")
def family(tmp_path_factory):
    return build_vl_family("smolvlm", tmp_path_factory.mktemp("smolvlm") / "ckpt")


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    """train.jsonl (8 rows) / test.jsonl (4): a one-colour picture, the question, the colour as the answer."""
    folder = tmp_path_factory.mktemp("colours")
    rows = []
    for name, rgb in COLOURS.items():
        for size in ((32, 32), (48, 32)):
            path = folder / f"{name}-{size[0]}.png"
            picture(rgb, size=size).save(path)
            rows.append({"question": QUESTION, "answer": name, "image": str(path)})
    (folder / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (folder / "test.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows[:4]))
    return folder, rows


def overrides(ckpt, folder, run_dir, *extra):
    return [
        "+recipe=sft_quickstart", f"model.path={ckpt}", f"trainer.run_dir={run_dir}", "sft.epochs=null",
        f"data.path={folder}", "data.subset=null", "data.image_key=image", "data.prompt_key=question",
        "data.answer_key=answer", f"data.system_prompt={SYSTEM}", "data.instruction=", "data.eval_size=4",
        "trainer.steps=3", "trainer.train_batch_size=8", "trainer.lr=1e-2", "trainer.warmup_steps=0",
        "trainer.lr_schedule=constant", "trainer.eval_every=0", "trainer.save_every=0", "trainer.device=cpu",
        "trainer.progress_bar=false", "trainer.curves=false", "logger=none", *extra,
    ]  # fmt: skip


def expected_first_loss(ckpt, rows) -> float:
    """Token-mean NLL, over all rows, of each row's assistant turn (the answer, `<|im_end|>` and the newline the
    template writes after it) given its prompt: transformers' forward on what the processor makes of the whole
    chat text, written here by hand."""
    from PIL import Image
    from transformers import AutoModelForImageTextToText

    processor = load_processor(ckpt)
    model = AutoModelForImageTextToText.from_pretrained(ckpt, dtype=torch.float32).eval()
    total, count = 0.0, 0
    for row in rows:
        prompt = (
            f"<|im_start|>system\n{SYSTEM}<|im_end|>\n<|im_start|>user\n<image>{QUESTION}<|im_end|>\n"
            "<|im_start|>assistant\n"
        )
        image = [Image.open(row["image"]).convert("RGB")]
        prompt_len = processor(text=[prompt], images=image, return_tensors="pt", add_special_tokens=False)
        prompt_len = prompt_len["input_ids"].shape[1]
        full = prompt + row["answer"] + "<|im_end|>\n"
        enc = processor(text=[full], images=image, return_tensors="pt", add_special_tokens=False)
        ids = enc["input_ids"]
        with torch.no_grad():
            logits = model(**enc).logits.double()
        logp = torch.log_softmax(logits[0, :-1], -1).gather(-1, ids[0, 1:, None]).squeeze(-1)
        total -= float(logp[prompt_len - 1 :].sum())
        count += ids.shape[1] - prompt_len
    return total / count


def parameters(folder) -> dict[str, torch.Tensor]:
    from transformers import AutoModelForImageTextToText

    model = AutoModelForImageTextToText.from_pretrained(folder, dtype=torch.float32)
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def part(name: str) -> str:
    if ".vision_model." in f".{name}":
        return "tower"
    return "connector" if ".connector." in f".{name}" else "language"


@pytest.fixture(scope="module")
def sft_run(family, data, tmp_path_factory):
    """`freeze_vision` -> (history, run dir) of a 3-step SFT run with model.freeze_language=true, run once on
    first use (the RL test starts from the default's, model.freeze_vision=true)."""
    done = {}

    def run(freeze_vision: bool):
        if freeze_vision not in done:
            folder, _ = data
            run_dir = tmp_path_factory.mktemp(f"sft-freeze-vision-{freeze_vision}") / "run"
            extra = ("model.freeze_language=true", f"model.freeze_vision={freeze_vision}")
            done[freeze_vision] = (
                sft.run(sft.load_config(compose(overrides(family, folder, run_dir, *extra)))),
                run_dir,
            )
        return done[freeze_vision]

    return run


@pytest.mark.parametrize("freeze_vision", [True, False])
def test_sft_on_images_trains_only_the_vision_side(family, data, sft_run, freeze_vision):
    _, rows = data
    history, run_dir = sft_run(freeze_vision)
    assert len(history) == 3
    # step 1 sees all 8 rows at the initial weights: its token-mean loss is the whole set's
    assert history[0]["loss"] == pytest.approx(expected_first_loss(family, rows), rel=1e-5)
    assert history[-1]["loss"] < history[0]["loss"]
    saved = run_dir / "checkpoints" / "step_3" / "model"
    assert load_processor(saved).image_processor is not None  # the checkpoint keeps its processor
    before, after = parameters(family), parameters(saved)
    assert before.keys() == after.keys()
    changed = {part(n) for n in before if not torch.equal(before[n], after[n])}
    frozen = {"language"} | ({"tower"} if freeze_vision else set())
    for name in before:
        if part(name) in frozen:
            assert torch.equal(before[name], after[name]), name  # bit-identical
    assert changed == {"connector", "tower"} - frozen


def test_rl_starts_from_the_sft_checkpoint(data, sft_run, tmp_path):
    folder, _ = data
    saved = sft_run(True)[1] / "checkpoints" / "step_3" / "model"
    rl = tmp_path / "rl"
    run_args(
        [
            "+recipe=quickstart_1digit", f"model.path={saved}", f"trainer.run_dir={rl}", "trainer.steps=1",
            "trainer.train_batch_size=4", "rollout.group_size=2", "rollout.max_new_tokens=4", "data.eval_size=4",
            f"data.path={folder}", "data.subset=null", "data.image_key=image", "data.max_prompt_tokens=128",
            "trainer.eval_every=0", "trainer.save_every=0", "trainer.progress_bar=false", "trainer.curves=false",
            "reward.fn=exact", "algo.mask_zero_std_groups=false", "logger=none", "rollout.engine=hf",
            "trainer.eval_at_start=true", "model.dtype=float32", "rollout.weight_sync_kl_threshold=1e-3",
        ]
    )  # fmt: skip
    lines = read_jsonl(rl / "metrics.jsonl")
    assert any("eval/pass@1" in m for m in lines) and any("reward/mean" in m for m in lines)


def test_freeze_language_is_refused_without_images_or_with_lora(family, data, tmp_path):
    folder, _ = data
    base = overrides(family, folder, tmp_path / "run", "model.freeze_language=true")
    with pytest.raises(
        ConfigError, match=r"model.freeze_language=true.*data.image_key.*valid: true \| false"
    ):
        sft.load_config(compose([*base, "data.image_key=null"]))
    with pytest.raises(ConfigError, match=r"model.freeze_language=true with model.lora.rank=4"):
        sft.load_config(compose([*base, "model.lora.rank=4"]))
    assert not (tmp_path / "run").exists()
