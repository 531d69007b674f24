"""scripts/see_warmup.py on a tiny Idefics3 (a 2-layer Llama with SmolLM2's tokenizer, rlkit/vlmodels.py's
vision side): the vision encoder and the connector train, the language model does not, and the run reports
held-out accuracy before and after."""

import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from rlkit.config.schema import REPO_ROOT
from rlkit.models import make_tiny_checkpoint
from rlkit.vlmodels import VisionShape, build_idefics3

sys.path.insert(0, str(REPO_ROOT / "scripts"))
import see_warmup  # noqa: E402

pytestmark = pytest.mark.slow  # trains a model for a few steps (tens of seconds)


def test_only_the_vision_side_trains_and_accuracy_is_measured(tmp_path):
    text = make_tiny_checkpoint(tmp_path / "text", hidden_size=64, num_layers=2)
    shape = VisionShape(hidden_size=32, intermediate_size=64, num_layers=1, num_heads=2)
    vl = build_idefics3(text, tmp_path / "vl", shape=shape, seed=0)
    out = see_warmup.main(
        ["--model", vl, "--num-train", "24", "--num-eval", "4", "--batch", "4", "--max-steps", "3"]
        + ["--eval-every", "2", "--lr", "1e-2", "--save", str(tmp_path / "warm")]
    )
    assert out["steps"] == 3 and [e["step"] for e in out["log"]] == [0, 2, 3]
    assert all(0.0 <= e["accuracy"] <= 1.0 for e in out["log"])
    before, after = (
        load_file(Path(vl) / "model.safetensors"),
        load_file(tmp_path / "warm" / "model.safetensors"),
    )
    assert before.keys() == after.keys()
    moved = {k for k in before if not torch.equal(before[k], after[k])}
    vision = {k for k in before if ".vision_model." in k or ".connector." in k}
    assert moved and moved <= vision  # the language model, its embeddings and head unchanged
    assert any(".connector." in k for k in moved) and any(".vision_model.encoder." in k for k in moved)
    assert (tmp_path / "warm" / "processor_config.json").exists()


def test_labels_cover_the_answer_and_the_end_of_turn_only(tmp_path):
    from transformers import AutoProcessor

    from rlkit.data.pictures import picture_rows

    text = make_tiny_checkpoint(tmp_path / "text", hidden_size=16, num_layers=1)
    vl = build_idefics3(
        text, tmp_path / "vl", shape=VisionShape(hidden_size=16, intermediate_size=32, num_layers=1)
    )
    processor = AutoProcessor.from_pretrained(vl)
    processor.tokenizer.padding_side = "left"
    rows = picture_rows(2, seed=0)
    enc = see_warmup.encode(processor, rows, with_answers=True)
    for i, row in enumerate(rows):
        labelled = enc["labels"][i][enc["labels"][i] != -100].tolist()
        assert processor.tokenizer.decode(labelled) == row["answer"] + "<|im_end|>"
