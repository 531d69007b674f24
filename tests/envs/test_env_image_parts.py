"""An environment's images as checked in its worker (rlkit/envs/images.py, `check_step`): decoded by the data
images' rule (data.max_image_pixels, data.resize_images) into `Pixels`, which cross the pipe as sizes and RGB
bytes and are rebuilt after a size check; malformed parts are refused with the part named. In process: no worker,
no model."""

from __future__ import annotations

import io

import pytest
from PIL import Image

from rlkit.envs.base import check_step
from rlkit.envs.images import PictureRule, Pixels, template_messages
from rlkit.envs.workers import EnvCall, Oversized, serve

RULE = PictureRule(max_pixels=10_000, resize=False)


def png(size=(40, 24), colour=(10, 200, 30)) -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", size, colour).save(buf, format="PNG")
    return buf.getvalue()


def observation(*parts, role="user"):
    return [{"role": role, "content": list(parts)}], 0.0, False


def test_an_image_part_is_decoded_to_pixels_that_rebuild_the_picture():
    picture = Image.new("RGB", (7, 5), (1, 2, 3))
    picture.putpixel((6, 4), (250, 0, 9))
    for value in (png((7, 5), (1, 2, 3)), picture, picture.convert("RGBA")):
        obs, _, _ = check_step(
            observation({"type": "image", "image": value}, {"type": "text", "text": "hi"}), RULE
        )
        pixels = obs[0]["content"][0]["image"]
        assert isinstance(pixels, Pixels) and (pixels.width, pixels.height) == (7, 5)
        assert obs[0]["content"][1] == {"type": "text", "text": "hi"}
    back = Pixels.of(picture).picture()
    assert (
        back.size == (7, 5) and back.tobytes() == picture.tobytes() and back.getpixel((6, 4)) == (250, 0, 9)
    )
    shown, pictures = template_messages(obs)
    assert shown[0]["content"] == [{"type": "image"}, {"type": "text", "text": "hi"}] and len(pictures) == 1


def test_pixels_whose_bytes_do_not_fit_their_sizes_are_refused():
    with pytest.raises(ValueError, match="a 4x4 picture needs 48 RGB bytes, got 47"):
        Pixels(4, 4, b"\0" * 47).picture()
    with pytest.raises(ValueError, match="positive int sizes"):
        Pixels(0, 4, b"").picture()


def test_the_size_rule_of_data_images_applies():
    big = png((200, 100))  # 20000 pixels, over 10000
    with pytest.raises(
        ValueError,
        match=r"observation\[0\]\['content'\]\[0\]: the image is 200x100 = 20000 pixels, "
        r"over data.max_image_pixels=10000 \(data.resize_images=true resizes it down\)",
    ):
        check_step(observation({"type": "image", "image": big}), RULE)
    obs, _, _ = check_step(observation({"type": "image", "image": big}), PictureRule(10_000, resize=True))
    pixels = obs[0]["content"][0]["image"]
    assert pixels.width * pixels.height <= 10_000 and abs(pixels.width / pixels.height - 2) < 0.05


@pytest.mark.parametrize(
    "part, message",
    [
        (
            {"type": "image", "image": b"garbage"},
            r"\['content'\]\[1\]: cannot decode the image \(UnidentifiedImageError",
        ),
        ({"type": "image", "image": 12}, r"cannot decode the image \(TypeError: not an image: a int\)"),
        ({"type": "image"}, "must hold its picture under 'image'"),
        ({"type": "video", "video": b""}, r"must be \{'type': 'text', 'text': str\} or \{'type': 'image'"),
        ({"type": "text", "text": 3}, r"must be \{'type': 'text'"),
        ("just a string", r"must be \{'type': 'text'"),
    ],
)
def test_malformed_parts_are_refused_naming_the_part(part, message):
    with pytest.raises((TypeError, ValueError), match=message):
        check_step(observation({"type": "text", "text": "ok"}, part), RULE)


def test_an_image_in_a_run_without_images_is_refused():
    with pytest.raises(ValueError, match="is an image, but this run takes none from its environment"):
        check_step(observation({"type": "image", "image": png()}), None)
    # Text parts alone need no rule.
    obs, _, _ = check_step(observation({"type": "text", "text": "a"}, {"type": "text", "text": "b"}), None)
    assert obs[0]["content"] == [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]


def test_too_many_pictures_are_refused():
    parts = [{"type": "image", "image": png((2, 2))}] * 17
    with pytest.raises(ValueError, match="holds more than 16 images"):
        check_step(observation(*parts), RULE)


def test_the_worker_reply_counts_text_characters_only_and_names_the_failure():
    class Env:
        def __init__(self, obs):
            self.obs = obs

        def step(self, text):
            return self.obs

    image = {"type": "image", "image": png((90, 100))}
    envs = {0: Env(observation(image, {"type": "text", "text": "x" * 30}))}
    reply = serve(envs, EnvCall(0, "step", ("t",), max_chars=40, pictures=RULE), "e", {})
    assert reply.ok and isinstance(reply.value[0][0]["content"][0]["image"], Pixels)  # 30 + len("user") <= 40
    reply = serve(envs, EnvCall(0, "step", ("t",), max_chars=30, pictures=RULE), "e", {})
    assert reply.ok and reply.value[0] == Oversized(34)
    envs = {0: Env(observation({"type": "image", "image": b"nope"}))}
    reply = serve(envs, EnvCall(0, "step", ("t",), pictures=RULE), "e", {})
    assert not reply.ok and reply.value.startswith("step returned a bad result: observation[0]['content'][0]: "
                                                   "cannot decode the image")  # fmt: skip


def test_the_look_tool_shows_the_rows_picture_once_when_asked():
    from rlkit.envs import make_env

    env = make_env("look")
    assert env.images and env.stop == ("<look/>",)
    question = [{"role": "user", "content": "How many shapes?"}]
    assert env.reset({"image": png((64, 64))}, question) == question
    obs, reward, done = check_step(env.step("Let me <look/>"), RULE_LARGE)
    assert reward == 0.0 and not done and obs[0]["role"] == "user"
    (image, text) = obs[0]["content"]
    assert (image["image"].width, image["image"].height) == (64, 64) and text == {
        "type": "text",
        "text": "Here is the picture.",
    }
    assert env.tool_calls == 1
    assert env.step("<look/> again") == (None, 0.0, True)  # once per episode
    fresh = make_env("look")
    fresh.reset({"image": png()}, question)
    assert fresh.step("#### 3") == (None, 0.0, True) and fresh.tool_calls == 0


def test_the_look_tool_draws_a_rows_shapes_one_per_quarter():
    from rlkit.data.pictures import COLOURS, SIZE
    from rlkit.envs import make_env

    env = make_env("look", {"role": "tool"})
    env.reset({"shapes": [["square", "red"], ["circle", "blue"], ["triangle", "green"]]}, [])
    obs, _, _ = check_step(env.step("<look/>"), RULE_LARGE)
    assert obs[0]["role"] == "tool"
    picture = obs[0]["content"][0]["image"].picture()
    assert picture.size == (SIZE, SIZE)
    half = SIZE // 2
    # The colours found in each quarter, by hand: red, blue, green, then nothing (white only).
    for quarter, colour in enumerate(["red", "blue", "green", None]):
        x0, y0 = (quarter % 2) * half, (quarter // 2) * half
        seen = {picture.getpixel((x, y)) for x in range(x0, x0 + half) for y in range(y0, y0 + half)}
        assert seen == ({(255, 255, 255), COLOURS[colour]} if colour else {(255, 255, 255)}), quarter
    with pytest.raises(KeyError, match="neither a 'image' column nor `shapes`"):
        make_env("look").reset({}, [])
    with pytest.raises(ValueError, match="unknown shape 'hexagon'"):
        make_env("look").reset({"shapes": [["hexagon", "red"]]}, [])


RULE_LARGE = PictureRule(max_pixels=1 << 20, resize=False)
