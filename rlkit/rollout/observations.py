"""An observation as the tokens appended after a model turn (rlkit/rollout/episodes.py), with the pictures an
environment showed in it (rlkit/envs/images.py).

The template's text between the conversation without and with the observation (the close of the model's turn,
the observation's messages, the next generation prompt) is rendered once; a text observation is then tokenised,
one with pictures goes through the model's processor, which expands each picture's placeholder to its image
tokens (as it does for a data prompt: rlkit/data/images.py) and gives the pictures' tensors, appended to the
episode's `Images`. The ids of prompt + response then equal the processor's rendering of the whole conversation
with all its pictures, so the learner's forward sees every picture where the engine did.
"""

from __future__ import annotations

from collections.abc import Callable

from rlkit.batch import Images
from rlkit.data.images import expand, join_images
from rlkit.envs.images import Pixels, has_pictures, template_messages

SENTINEL = "RLKIT_MODEL_TURN_SENTINEL"


def observation_text(
    render: Callable, history: list[dict], observation: list[dict], sampled_eos: str | None
) -> str:
    """The text a chat template (`render(messages, add_generation_prompt=...)` -> str) adds after a model turn:
    its close, the observation messages and the next generation prompt.

    `history` is the conversation before the model turn; the turn itself is rendered as a sentinel, so what the
    template adds does not depend on how it would re-render the model's text. `sampled_eos`: the text of the EOS
    token the turn ended with, if any (already in the sequence)."""
    conv = [*history, {"role": "assistant", "content": SENTINEL}]
    without = render(conv, add_generation_prompt=False)
    with_obs = render([*conv, *observation], add_generation_prompt=True)
    if not with_obs.startswith(without):
        raise ValueError(
            "the tokenizer's chat template is not prefix-stable (adding a message re-renders earlier ones), "
            "so observations cannot be appended to the sampled tokens; use a template that only appends"
        )
    delta = without[without.rindex(SENTINEL) + len(SENTINEL) :] + with_obs[len(without) :]
    if sampled_eos and delta.startswith(sampled_eos):
        delta = delta[len(sampled_eos) :]
    return delta


def observation_tokens(
    tokenizer, history: list[dict], observation: list[dict], sampled_eos: str | None, *, processor=None,
    images: Images | None = None,
) -> tuple[list[int], Images | None]:  # fmt: skip
    """(token ids to append after a model turn, the episode's Images after them). Without pictures in the
    conversation: the tokenizer's template and tokens, `images` unchanged. With pictures (image parts holding
    `Pixels`, earlier observations' included): the processor's template renders them as placeholders, and the
    observation's own pictures are expanded by the processor and joined to `images`. Raises ValueError when there
    is no processor (the run takes no images) or the processor refuses the pictures."""
    with_pictures = has_pictures([*history, *observation])
    if with_pictures and processor is None:
        raise ValueError("an observation shows a picture, but this run has no processor to render it")
    chat = processor if with_pictures else tokenizer  # the processor's template renders image parts

    def render(messages, add_generation_prompt):
        return chat.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)

    if not with_pictures:
        delta = observation_text(render, history, observation, sampled_eos)
        return tokenizer(delta, add_special_tokens=False).input_ids, images
    shown_history, _ = template_messages(history)
    shown, pictures = template_messages(observation)
    delta = observation_text(render, shown_history, shown, sampled_eos)
    if not pictures:
        return processor.tokenizer(delta, add_special_tokens=False).input_ids, images
    ids, new = expand(processor, delta, pictures)
    return ids, join_images(images, new)


def check_picture_template(processor, messages: list[dict], where: str) -> None:
    """At start-up: the processor's chat template renders an observation's image part as a placeholder the
    processor expands to one picture's tokens (raises ValueError naming `where` and why)."""
    probe = [
        {
            "role": "user",
            "content": [
                {"type": "image", "image": Pixels(8, 8, bytes(3 * 64))},
                {"type": "text", "text": "1"},
            ],
        }
    ]
    try:
        _, images = observation_tokens(processor.tokenizer, messages, probe, None, processor=processor)
    except Exception as e:
        raise ValueError(
            f"{where}: the model's processor cannot render a picture in an observation ({e})"
        ) from e
    if images is None or len(images.pictures) != 1:
        raise ValueError(f"{where}: the model's processor rendered no picture of an observation's image part")
