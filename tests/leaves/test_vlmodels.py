"""rlkit/vlmodels.py: the embedded SmolLM2-135M given a random vision encoder, as an Idefics3 checkpoint with its
processor, built offline into the cache (`model.path=smollm2-135m-vl`)."""

import io
from pathlib import Path

import pytest
import torch
from PIL import Image

from rlkit import models
from rlkit.data.pictures import picture_rows
from rlkit.models import resolve_model
from rlkit.vlmodels import VisionShape, build_idefics3

pytestmark = pytest.mark.slow  # converts and loads the embedded model: `make test-fast` leaves it out


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    text_dir, _ = resolve_model("smollm2-135m")
    return text_dir, build_idefics3(text_dir, tmp_path_factory.mktemp("vl") / "vl", seed=0)


def _picture(i: int):
    return Image.open(io.BytesIO(picture_rows(i + 1, seed=5)[i]["image"])).convert("RGB")


def test_text_side_is_smollm2_unchanged(built):
    from transformers import AutoModelForImageTextToText, AutoTokenizer, LlamaForCausalLM

    text_dir, vl_dir = built
    lm = LlamaForCausalLM.from_pretrained(text_dir, dtype=torch.float32)
    vl = AutoModelForImageTextToText.from_pretrained(vl_dir, dtype=torch.float32)
    text_tok = AutoTokenizer.from_pretrained(text_dir)
    ids = text_tok("The capital of France is", return_tensors="pt").input_ids
    with torch.no_grad():
        want, got = lm(input_ids=ids).logits, vl(input_ids=ids).logits
    assert got.shape[-1] == want.shape[-1] + 40  # the image tokens, appended to the vocabulary
    torch.testing.assert_close(got[..., : want.shape[-1]], want, atol=1e-4, rtol=1e-4)
    # the chat template of a text-only chat is SmolLM2's own
    from transformers import AutoProcessor

    processor = AutoProcessor.from_pretrained(vl_dir)
    chat = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    assert processor.apply_chat_template(chat, add_generation_prompt=True) == text_tok.apply_chat_template(
        chat, add_generation_prompt=True, tokenize=False
    )


def test_a_picture_becomes_its_image_tokens_and_reaches_the_logits(built):
    from transformers import AutoModelForImageTextToText, AutoProcessor

    _, vl_dir = built
    processor = AutoProcessor.from_pretrained(vl_dir)
    model = AutoModelForImageTextToText.from_pretrained(vl_dir, dtype=torch.float32)
    chat = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "How many shapes?"}]}]
    text = processor.apply_chat_template(chat, add_generation_prompt=True)
    assert "<image>How many shapes?" in text
    logits = []
    for i in (0, 1):
        enc = processor(text=[text], images=[[_picture(i)]], return_tensors="pt")
        image_id = processor.tokenizer.convert_tokens_to_ids("<image>")
        assert (enc["input_ids"] == image_id).sum() == 16 == VisionShape().image_seq_len  # 8x8 patches / 2x2
        assert enc["pixel_values"].shape == (1, 1, 3, 64, 64)
        with torch.no_grad():
            logits.append(model(**enc).logits[0, -1])
    assert not torch.allclose(logits[0], logits[1], atol=1e-3)  # the vision side reaches the language model


def test_the_build_is_seeded_and_kept(built, tmp_path):
    from safetensors.torch import load_file

    text_dir, vl_dir = built
    again = build_idefics3(text_dir, tmp_path / "again", seed=0)
    other = build_idefics3(text_dir, tmp_path / "other", seed=1)
    a, b, c = (load_file(Path(d) / "model.safetensors") for d in (vl_dir, again, other))
    vision = [k for k in a if "vision_model" in k or "connector" in k]
    assert vision and all(torch.equal(a[k], b[k]) for k in vision)
    assert not all(torch.equal(a[k], c[k]) for k in vision)
    stamp = (Path(again) / "model.safetensors").stat().st_mtime_ns
    assert build_idefics3(text_dir, again, seed=1) == again  # an existing checkpoint is kept as it is
    assert (Path(again) / "model.safetensors").stat().st_mtime_ns == stamp


def test_the_short_name_builds_into_the_cache(monkeypatch, tmp_path):
    text_dir, _ = resolve_model("smollm2-135m")
    (tmp_path / "models").mkdir()
    (tmp_path / "models" / Path(text_dir).name).symlink_to(text_dir)  # the converted text model, not redone
    monkeypatch.setenv("RLKIT_CACHE", str(tmp_path))
    path, gguf = resolve_model("smollm2-135m-vl")
    assert gguf is None and Path(path).parent == tmp_path / "models" and (Path(path) / "config.json").exists()
    assert (Path(path) / "processor_config.json").exists()
    assert resolve_model("smollm2-135m-vl") == (path, None)
    with pytest.raises(FileNotFoundError, match="smollm2-135m-vl"):
        resolve_model("./no-such-model")
    assert "smollm2-135m-vl" in models.BUILT_MODELS
