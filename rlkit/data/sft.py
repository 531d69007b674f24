"""Supervised fine-tuning rows: chat messages or prompt/completion pairs, tokenised with the tokenizer's chat
template, with a loss mask on the assistant's tokens only (`python -m rlkit.sft`, rlkit/sft.py).

A row is either a chat, `row[sft.messages_key]` = [{"role": ..., "content": ...}, ...] (system, user,
assistant, tool), or a prompt/completion pair: `row[data.prompt_key]` templated exactly as RL prompts are
(rlkit/data/prompts.py: data.system_prompt, data.instruction), then the assistant's `row[sft.completion_key]`
(null = data.answer_key). So a model fine-tuned on the pairs sees, at RL time, the prompt it was trained on.

Which tokens train: every assistant turn, from the end of the generation prompt that precedes it to the end of
the turn as the template renders it (its end-of-turn token and what the template puts after it), the tokens a
model must produce. They are found by rendering the chat's prefixes (`messages[:i]` with the generation prompt,
`messages[:i+1]` without): the tokens between the two are turn i's. The system prompt, the user's and the tool
turns, and the template's own framing of them, are masked. A template whose rendering of a prefix is not a
prefix of the whole chat's rendering (one that rewrites earlier turns, e.g. drops past reasoning) is refused
for that row, by name: its masks could not be right.

Rows with images (`data.image_key`, a vision-language model with its processor; the same column, values and
rules as RL's prompts, rlkit/data/images.py): the row's images go into the user turn that the first assistant
turn answers (at its `<image>` marks, else before its text), the chat is rendered by the processor's template
and the processor expands each image placeholder into the image's tokens, so the ids are the expanded ones the
model reads, and the row carries one `rlkit.batch.Images` (the processor's tensors) into the learner's forward.
The loss mask is found on the unexpanded rendering, as above, and moved past the expansion (which lies before
every assistant token; a rendering where it does not is refused for that row, by name).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from rlkit.batch import Images, TrainBatch
from rlkit.config.rules import choice, nonempty
from rlkit.config.schema import ConfigError, DataConfig, SFTConfig
from rlkit.data.images import TOKEN_KEYS, ImageError, column_pictures, digest, vl_messages
from rlkit.data.loading import DataError
from rlkit.data.prompts import prompt_messages

log = logging.getLogger(__name__)

OVERLONG = ("truncate", "drop")  # sft.overlong
ROLES = ("system", "user", "assistant", "tool")


def check_config(cfg) -> None:
    """The `sft.*` keys (their ranges are rlkit/config/rules.py's), before anything loads."""
    s = cfg.sft
    nonempty("sft.messages_key", s.messages_key)
    if s.completion_key is not None:
        nonempty("sft.completion_key", s.completion_key)
    choice("sft.overlong", s.overlong, OVERLONG)


@dataclass(frozen=True)
class SFTSet:
    """Tokenised rows: index i of both lists is one row (its full token ids and its loss mask)."""

    token_ids: list[list[int]]
    loss_masks: list[list[bool]]
    truncated: int = 0
    """Rows cut to sft.max_length (sft.overlong=truncate)."""
    dropped: int = 0
    """Rows left out: longer than sft.max_length (sft.overlong=drop), or with no assistant token left after the cut."""
    images: list[Images | None] | None = None
    """With data.image_key: each row's images (None for a row without any); None for a text set."""

    def __len__(self) -> int:
        return len(self.token_ids)

    @property
    def loss_tokens(self) -> int:
        return sum(sum(m) for m in self.loss_masks)


def _short(value, limit: int = 200) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[:limit] + "..."


def row_messages(row: dict, index: int, split: str, data: DataConfig, sft: SFTConfig) -> list[dict]:
    """The chat of one row (1-based `index` in its `split`), checked; a DataError names the key, row and value."""
    where = f"row {index} of split {split!r}"
    if sft.messages_key in row and row[sft.messages_key] is not None:
        messages = row[sft.messages_key]
        key = f"sft.messages_key={sft.messages_key!r}"
        if not isinstance(messages, list | tuple) or not messages:
            raise DataError(f"{where}: {key} holds {_short(messages)}, not a non-empty list of messages")
        for m in messages:
            if not isinstance(m, dict) or m.get("role") not in ROLES or not isinstance(m.get("content"), str):
                raise DataError(
                    f"{where}: {key} holds the message {_short(m)}; each message must be "
                    f"{{'role': one of {list(ROLES)}, 'content': a string}}"
                )
        if not any(m["role"] == "assistant" for m in messages):
            raise DataError(
                f"{where}: {key} holds no assistant turn (nothing to train on): {_short(messages)}"
            )
        if messages[0]["role"] == "assistant":
            raise DataError(
                f"{where}: {key} begins with an assistant turn (nothing it answers): {_short(messages)}"
            )
        return [{"role": m["role"], "content": m["content"]} for m in messages]
    completion_key = sft.completion_key or data.answer_key
    for name, key in (("data.prompt_key", data.prompt_key), ("sft.completion_key", completion_key)):
        if not isinstance(row.get(key), str):
            raise DataError(
                f"{where}: {name}={key!r} holds {_short(row.get(key))}, not a string, and the row has no "
                f"{sft.messages_key!r} column (sft.messages_key) either; its columns: {sorted(row)}"
            )
    if not row[completion_key].strip():
        raise DataError(
            f"{where}: the completion ({completion_key!r}) is empty: no assistant turn to train on"
        )
    return [
        *prompt_messages(row[data.prompt_key], data),
        {"role": "assistant", "content": row[completion_key]},
    ]


def _render(tokenizer, messages: list[dict], *, generation_prompt: bool, template=None) -> list[int]:
    """The chat's token ids through `template`'s chat template (a VL model's processor; default the tokenizer's),
    image placeholders unexpanded."""
    text = (template or tokenizer).apply_chat_template(
        messages, add_generation_prompt=generation_prompt, tokenize=False
    )
    return tokenizer(text, add_special_tokens=False).input_ids  # the template already holds BOS where wanted


def chat_tokens(
    messages: list[dict], tokenizer, *, where: str = "the row", template=None
) -> tuple[list[int], list[bool]]:
    """(token ids, loss mask) of a chat: the mask is True on the tokens of every assistant turn (see the module).
    `template`: what renders the chat (a VL model's processor), else the tokenizer."""
    ids = _render(tokenizer, messages, generation_prompt=False, template=template)
    mask = [False] * len(ids)
    for i, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        start = len(_render(tokenizer, messages[:i], generation_prompt=True, template=template))
        upto = _render(tokenizer, messages[: i + 1], generation_prompt=False, template=template)
        if ids[: len(upto)] != upto:
            raise DataError(
                f"{where}: the chat template renders the chat up to assistant turn {i} differently from the "
                "same turns inside the whole chat (it rewrites earlier turns), so its assistant tokens cannot be "
                "told apart; split the row into one row per assistant turn"
            )
        mask[start : len(upto)] = [True] * (len(upto) - start)
    return ids, mask


def image_chat(
    messages: list[dict], pictures: list, data: DataConfig, row: int, value, where: str
) -> list[dict]:
    """The chat with its `pictures` in the user turn that the first assistant turn answers
    (`rlkit.data.images.vl_messages`: at its `<image>` marks, else before its text)."""
    first = next(i for i, m in enumerate(messages) if m["role"] == "assistant")
    if messages[first - 1]["role"] != "user":
        raise DataError(
            f"{where}: data.image_key={data.image_key!r} gives images, but the turn before the first assistant "
            f"turn is a {messages[first - 1]['role']!r} turn, not the user's that the images belong to"
        )
    return [*vl_messages(messages[:first], len(pictures), data, row, value), *messages[first:]]


def image_tokens(
    messages: list[dict], pictures: list, processor, *, where: str
) -> tuple[list[int], list[bool], Images]:
    """(expanded token ids, loss mask, Images) of a chat whose images sit in a user turn (`image_chat`): the
    processor renders and expands it once; the mask, found on the unexpanded rendering (`chat_tokens`), moves
    past the expansion, which must lie before the first assistant token with every later token unchanged."""
    tokenizer = processor.tokenizer
    short, short_mask = chat_tokens(messages, tokenizer, where=where, template=processor)
    text = processor.apply_chat_template(messages, add_generation_prompt=False, tokenize=False)
    out = processor(text=[text], images=pictures, return_tensors="pt", add_special_tokens=False)
    ids = out["input_ids"][0].tolist()
    shift = len(ids) - len(short)
    first = short_mask.index(True) if True in short_mask else len(short)
    if shift < 0 or ids[first + shift :] != short[first:]:
        raise DataError(
            f"{where}: the processor's expansion of the image placeholders changes the tokens of the assistant "
            "turns (or lies after the first of them), so the loss mask cannot be placed on the expanded ids"
        )
    mask = [False] * shift + short_mask
    tensors = {k: v for k, v in out.items() if k not in TOKEN_KEYS and isinstance(v, torch.Tensor)}
    return ids, mask, Images(tuple(pictures), tensors, digest(pictures))


def check_tokenizer(tokenizer, model_path: str) -> None:
    """A chat needs the tokenizer's chat template: refuse a tokenizer without one at start-up."""
    if not getattr(tokenizer, "chat_template", None):
        raise ConfigError(
            f"model.path={model_path!r}: its tokenizer has no chat template, which python -m rlkit.sft needs to "
            "render rows and find the assistant's tokens; use a model (or tokenizer) that has one"
        )


def row_tokens(
    row: dict, index: int, split: str, tokenizer, data: DataConfig, sft: SFTConfig, processor=None
):
    """(token ids, loss mask, Images or None) of dataset row `index` (1-based) of `split`."""
    where = f"row {index} of split {split!r}"
    messages = row_messages(row, index, split, data, sft)
    if data.image_key is None:
        return (*chat_tokens(messages, tokenizer, where=where), None)
    try:
        value, pictures = column_pictures(row, data, index)
    except ImageError:
        raise
    except ValueError as e:  # no such column
        raise DataError(str(e)) from e
    if not pictures:
        return (*chat_tokens(messages, tokenizer, where=where, template=processor), None)
    chat = image_chat(messages, pictures, data, index, value, where)
    return image_tokens(chat, pictures, processor, where=where)


def build_sft_set(
    dataset, tokenizer, data: DataConfig, sft: SFTConfig, *, split: str = "train", processor=None
) -> SFTSet:
    """Render, tokenise and mask every row of `dataset`; apply sft.max_length as sft.overlong says (counted and
    logged). An empty result is a DataError naming the keys that emptied it. With data.image_key, `processor`
    (the VL model's) renders the rows and expands their images (see the module)."""
    if data.image_key is not None and processor is None:
        raise ValueError(
            f"data.image_key={data.image_key!r} needs a vision-language model with its processor"
        )
    ids, masks, images = [], [], []
    truncated = dropped = 0
    for i, row in enumerate(dataset):
        tokens, mask, pictures = row_tokens(dict(row), i + 1, split, tokenizer, data, sft, processor)
        if len(tokens) > sft.max_length:
            if sft.overlong == "drop":
                dropped += 1
                continue
            tokens, mask = tokens[: sft.max_length], mask[: sft.max_length]
            truncated += 1
        if not any(mask[1:]):  # the first token has no prefix to predict it from
            dropped += 1
            continue
        ids.append(tokens)
        masks.append(mask)
        images.append(pictures)
    log.info(
        "%s rows: %d kept, %d truncated to sft.max_length=%d, %d dropped (sft.overlong=%s)",
        split, len(ids), truncated, sft.max_length, dropped, sft.overlong,
    )  # fmt: skip
    if not ids:
        raise DataError(
            f"split {split!r}: no row is left to train on ({dropped} of {len(dataset)} rows dropped): with "
            f"sft.overlong={sft.overlong!r} and sft.max_length={sft.max_length}, every row is too long or loses "
            "all its assistant tokens; raise sft.max_length"
        )
    return SFTSet(ids, masks, truncated, dropped, images if data.image_key is not None else None)


def train_batch(
    token_ids: Sequence[Sequence[int]], masks: Sequence[Sequence[bool]], pad_id: int, images=None
) -> TrainBatch:
    """Rows as the learner's TrainBatch: the first token is the prompt (nothing predicts it), the rest the
    response, right-padded, its mask the loss mask. `advantages` are zeros: the `nll` loss reads none. `images`:
    each row's Images or None (the VL forward finds their placeholders anywhere in the row's ids)."""
    n, width = len(token_ids), max(len(t) for t in token_ids) - 1
    response = torch.full((n, width), pad_id, dtype=torch.long)
    mask = torch.zeros(n, width, dtype=torch.bool)
    for i, (t, m) in enumerate(zip(token_ids, masks)):
        response[i, : len(t) - 1] = torch.tensor(t[1:], dtype=torch.long)
        mask[i, : len(t) - 1] = torch.tensor(m[1:], dtype=torch.bool)
    prompt = torch.tensor([[t[0]] for t in token_ids], dtype=torch.long)
    return TrainBatch(
        prompt_ids=prompt, prompt_mask=torch.ones_like(prompt, dtype=torch.bool), response_ids=response,
        response_mask=mask, advantages=torch.zeros(n, width),
        images=tuple(images) if images is not None and any(x is not None for x in images) else None,
    )  # fmt: skip
