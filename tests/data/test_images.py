"""data.image_key: rows with images rendered through the VL model's processor into expanded prompt ids and one
Images per prompt; bad images are start-up errors naming the key, the row and the value."""

from __future__ import annotations

import io

import pytest
from vl_families import build_vl_family, picture

from rlkit.config.schema import DataConfig
from rlkit.data.images import ImageError, digest
from rlkit.data.prompts import build_prompts
from rlkit.vision import load_processor


@pytest.fixture(scope="module")
def processor(tmp_path_factory):
    return load_processor(build_vl_family("qwen2.5-vl", tmp_path_factory.mktemp("qwen25vl")))


def cfg(**kw) -> DataConfig:
    return DataConfig(
        path="/nonexistent", image_key="image", prompt_key="q", answer_key="a", instruction="", **kw
    )


def png(img) -> bytes:
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    return buf.getvalue()


def test_rows_with_images_in_every_form(processor, tmp_path):
    red, green = picture((255, 0, 0)), picture((0, 255, 0), size=(112, 56))
    path = tmp_path / "g.png"
    green.save(path)
    rows = [
        {"q": "What colour?", "a": "red", "image": red},  # a PIL image (a decoded datasets Image feature)
        {"q": "What colour?", "a": "green", "image": str(path)},  # a path
        {
            "q": "<image> vs <image>: same?",
            "a": "no",
            "image": [{"bytes": png(red), "path": None}, png(green)],
        },
    ]
    ps = build_prompts(rows, processor.tokenizer, cfg(), processor=processor)
    pad = processor.tokenizer.convert_tokens_to_ids("<|image_pad|>")
    # 56x56 -> 4x4 patches of 14 -> 4 tokens after the 2x2 merge; 112x56 -> 8x4 -> 8 tokens
    assert [sum(t == pad for t in ids) for ids in ps.token_ids] == [4, 8, 12]
    assert ps.images[0].tensors["image_grid_thw"].tolist() == [[1, 4, 4]]
    assert ps.images[2].tensors["image_grid_thw"].tolist() == [[1, 4, 4], [1, 4, 8]]
    assert ps.images[2].tensors["pixel_values"].shape[0] == 16 + 32
    assert ps.images[0].digest == digest([red]) != ps.images[1].digest
    assert ps.rows[0]["image"] == ps.images[0].digest  # rows carry the digest, not the picture
    # The placeholders sit where the question's <image> marks were: text between the two images.
    text = ps.texts[2]
    assert text.index("<|vision_start|>") < text.index(" vs ") < text.rindex("<|vision_start|>")
    # The ids are the processor's own expansion of the rendered text.
    again = processor(
        text=[text], images=list(ps.images[2].pictures), return_tensors="pt", add_special_tokens=False
    )
    assert again["input_ids"][0].tolist() == ps.token_ids[2]


def test_image_tokens_count_in_max_prompt_tokens(processor):
    rows = [{"q": "Colour?", "a": "x", "image": picture(size=(56, 56))},
            {"q": "Colour?", "a": "x", "image": picture(size=(224, 224))}]  # fmt: skip
    short = build_prompts(rows[:1], processor.tokenizer, cfg(), processor=processor)
    limit = len(short.token_ids[0])  # the small picture's prompt fits exactly; the big one's 64 tokens do not
    ps = build_prompts(rows, processor.tokenizer, cfg(max_prompt_tokens=limit), processor=processor)
    assert len(ps) == 1 and ps.dropped == 1


def test_bad_images_name_the_key_row_and_value(processor, tmp_path):
    tok = processor.tokenizer
    ok = {"q": "Colour?", "a": "x", "image": picture()}
    with pytest.raises(
        ImageError, match=r"data\.image_key='image', row 2, value .*not-an-image.*cannot decode"
    ):
        build_prompts(
            [ok, {**ok, "image": str(tmp_path / "not-an-image.png")}], tok, cfg(), processor=processor
        )
    with pytest.raises(ImageError, match=r"row 1, value <5 bytes>: cannot decode"):
        build_prompts([{**ok, "image": b"abcde"}], tok, cfg(), processor=processor)
    with pytest.raises(ImageError, match=r"row 1.*2 image\(s\) but 1 <image> placeholder"):
        build_prompts(
            [{**ok, "q": "<image> colour?", "image": [picture(), picture()]}], tok, cfg(), processor=processor
        )
    big = {**ok, "image": picture(size=(100, 100))}
    with pytest.raises(ImageError, match=r"row 1.*100x100 = 10000 pixels, over data\.max_image_pixels=5000"):
        build_prompts([big], tok, cfg(max_image_pixels=5000), processor=processor)
    ps = build_prompts([big], tok, cfg(max_image_pixels=5000, resize_images=True), processor=processor)
    w, h = ps.images[0].pictures[0].size
    assert w == h == 70 and w * h <= 5000  # sqrt(5000) = 70.7


def test_image_key_without_processor_is_an_error(processor):
    with pytest.raises(ValueError, match=r"data\.image_key='image' needs a vision-language model"):
        build_prompts([{"q": "x", "a": "y", "image": picture()}], processor.tokenizer, cfg())


def test_start_up_checks_name_the_keys(tmp_path, tiny_ckpt):
    from rlkit.config.schema import ConfigError, RLConfig
    from rlkit.data.loading import check_images

    def rl(model_path, **data):
        c = RLConfig()
        c.model.path = model_path
        c.data.image_key = "image"
        for k, v in data.items():
            setattr(c.data, k, v)
        return c

    with pytest.raises(
        ConfigError, match=r"data\.image_key='image' gives images, but model\.path=.* text-only"
    ):
        check_images(rl(tiny_ckpt))
    noproc = build_vl_family("qwen2.5-vl", tmp_path / "noproc", processor=False)
    with pytest.raises(ConfigError, match=r"model\.path=.* vision-language checkpoint without a processor"):
        check_images(rl(noproc))
    with pytest.raises(ConfigError, match=r"data\.max_image_pixels=0"):
        check_images(rl(noproc, max_image_pixels=0))
    with pytest.raises(ConfigError, match=r"data\.image_key='question' must be a column name other"):
        check_images(rl(noproc, image_key="question"))
    check_images(rl(build_vl_family("qwen2.5-vl", tmp_path / "ok")))  # a VL checkpoint with its processor
