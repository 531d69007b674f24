"""Prompts: templating and tokenising each dataset row, length filtering, and the deterministic, resumable
prompt order."""

from __future__ import annotations

import logging
import weakref
from dataclasses import dataclass, field

import numpy as np

from rlkit.config.schema import DataConfig
from rlkit.data import reasoning_gym

log = logging.getLogger(__name__)

TEMPLATES = ("chat", "plain")


@dataclass(frozen=True)
class PromptSet:
    """Tokenised prompts with their reference answers (index i of every list is one problem)."""

    token_ids: list[list[int]]
    texts: list[str]
    answers: list[str]
    messages: list[list[dict]] = field(default_factory=list)
    """The chat messages of each prompt (system + user), before any template: a reward model renders
    them with its own chat template."""
    rows: list[dict] = field(default_factory=list)
    """Every column of each prompt's dataset row."""
    dropped: int = 0
    """Rows left out as longer than `data.max_prompt_tokens` (those far too long without being tokenized)."""
    images: list = field(default_factory=list)
    """With `data.image_key`: each prompt's `rlkit.batch.Images` (None for a row without images), built once
    here; the prompt's token ids hold its placeholders expanded. Empty for text data."""

    def __len__(self) -> int:
        return len(self.token_ids)


def prompt_messages(question: str, cfg: DataConfig) -> list[dict]:
    """The chat messages of one question: the optional system prompt, then the question + instruction."""
    user = f"{question}\n{cfg.instruction}" if cfg.instruction else question
    text = cfg.system_prompt
    if text and text.startswith(reasoning_gym.SYSTEM_PROMPT_PREFIX):
        text = reasoning_gym.system_prompt(text.removeprefix(reasoning_gym.SYSTEM_PROMPT_PREFIX))
    system = [{"role": "system", "content": text}] if text else []
    return [*system, {"role": "user", "content": user}]


def render_prompt(question: str, tokenizer, cfg: DataConfig) -> tuple[str, list[int]]:
    """Prompt text and token ids for one question (chat template, or the plain template as fallback)."""
    messages = prompt_messages(question, cfg)
    if cfg.template == "chat" and getattr(tokenizer, "chat_template", None):
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        # The template already contains BOS where the model wants it.
        return text, tokenizer(text, add_special_tokens=False).input_ids
    text = f"Question: {messages[-1]['content']}\nAnswer:"
    return text, tokenizer(text).input_ids


def max_chars(tokenizer, tokens: int) -> int | None:
    """The most characters a text of `tokens` tokens can have, or None when the tokenizer has no vocabulary to
    measure: a text longer than that is refused without being tokenized (a data row, an environment's first
    messages or observation), which for a 50 MB row would take minutes.

    A token stands for at most as many characters as its longest vocabulary entry (byte-level BPE spells each
    byte as one character, so an entry is never shorter than the text it decodes to; SmolLM2's longest is 81);
    x2 is a margin for a normalizer that drops characters before tokenizing."""
    longest = max_token_chars(tokenizer)
    return None if longest is None else 2 * tokens * longest


def max_prompt_chars(tokenizer, cfg: DataConfig) -> int | None:
    """The most characters a question can have and still fit `cfg.max_prompt_tokens` in any template
    (`max_chars`)."""
    return max_chars(tokenizer, cfg.max_prompt_tokens)


def max_token_chars(tokenizer) -> int | None:
    """The characters of the tokenizer's longest vocabulary entry (the most text one token can stand for, see
    `max_prompt_chars`), or None when it has no vocabulary to measure. Remembered per tokenizer and vocabulary
    size (building the vocabulary takes ~0.1 s at 49k tokens, and every generation call asks)."""
    get_vocab = getattr(tokenizer, "get_vocab", None)
    if get_vocab is None:
        return None
    try:  # the vocabulary's size tells a tokenizer that gained tokens since; without one, measure each time
        size, known = len(tokenizer), _LONGEST_ENTRY.get(tokenizer)
    except TypeError:  # no len(), or not weakly referenceable
        size = known = None
    if known is not None and known[0] == size:
        return known[1]
    longest = max(max((len(t) for t in get_vocab()), default=1), 1)
    if size is not None:
        _LONGEST_ENTRY[tokenizer] = (size, longest)
    return longest


_LONGEST_ENTRY: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # tokenizer -> (len, longest entry)


def build_prompts(dataset, tokenizer, cfg: DataConfig, *, name: str = "train", processor=None) -> PromptSet:
    """Template and tokenise every row; drop prompts over `cfg.max_prompt_tokens` (count logged), those far
    too long to ever fit (`max_prompt_chars`) before tokenizing them (one warning).

    With `cfg.image_key` (and the model's `processor`), each row's images are decoded and the prompt rendered
    through the processor (rlkit/data/images.py): its ids hold the expanded image tokens, which count in
    `cfg.max_prompt_tokens`; the row's image column is replaced by the images' digest in `rows`."""
    if cfg.template == "chat" and not getattr(tokenizer, "chat_template", None):
        log.warning("data.template='chat' but the tokenizer has no chat template: using the plain template")
    if cfg.image_key is not None and processor is None:
        raise ValueError(f"data.image_key={cfg.image_key!r} needs a vision-language model with its processor")
    ids, texts, answers, messages, rows, images = [], [], [], [], [], []
    dropped = 0
    max_chars, huge = max_prompt_chars(tokenizer, cfg), []
    for i, row in enumerate(dataset):
        question = row[cfg.prompt_key]
        if max_chars is not None and len(question) > max_chars:
            huge.append((i + 1, len(question)))
            continue
        row = dict(row)
        if cfg.image_key is None:
            text, tok = render_prompt(question, tokenizer, cfg)
        else:
            text, tok, pictures = _render_row(question, row, processor, cfg, i + 1)
        if len(tok) > cfg.max_prompt_tokens:
            dropped += 1
            continue
        ids.append(tok)
        texts.append(text)
        answers.append(str(row[cfg.answer_key]))
        messages.append(prompt_messages(question, cfg))
        rows.append(row)
        if cfg.image_key is not None:
            images.append(pictures)
    if huge:
        log.warning(
            "%s prompts: dropped %d rows of over %d characters without tokenizing them (data.max_prompt_tokens"
            "=%d could never hold them): %s%s",
            name, len(huge), max_chars, cfg.max_prompt_tokens,
            ", ".join(f"row {r} ({n} characters)" for r, n in huge[:5]), " ..." if len(huge) > 5 else "",
        )  # fmt: skip
    log.info(
        "%s prompts: %d kept, %d dropped (longer than data.max_prompt_tokens=%d)",
        name,
        len(ids),
        dropped + len(huge),
        cfg.max_prompt_tokens,
    )
    if not ids:
        raise ValueError(f"no {name} prompt fits data.max_prompt_tokens={cfg.max_prompt_tokens}")
    return PromptSet(ids, texts, answers, messages, rows, dropped + len(huge), images)


def _render_row(question: str, row: dict, processor, cfg: DataConfig, number: int):
    """(text, expanded ids, Images or None) of dataset row `number` (1-based) with images; the row's image
    column becomes the images' digest."""
    from rlkit.data import images as row_images  # defers torch (rlkit.batch)

    value, pictures = row_images.column_pictures(row, cfg, number)
    text, tok, imgs = row_images.render_with_images(
        prompt_messages(question, cfg), pictures, processor, cfg, number, value
    )
    row[cfg.image_key] = imgs.digest if imgs is not None else None
    return text, tok, imgs


class PromptOrder:
    """A deterministic, endless prompt order: epoch e is a permutation seeded by (seed, e).

    The whole state is `position` (prompts consumed so far over all ranks), so resuming is setting it.
    """

    def __init__(self, num_prompts: int, seed: int, position: int = 0):
        self.num_prompts = num_prompts
        self.seed = seed
        self.position = position
        self._perm_epoch = -1
        self._perm: np.ndarray | None = None

    def _permutation(self, epoch: int) -> np.ndarray:
        if epoch != self._perm_epoch:
            self._perm = np.random.default_rng([self.seed, epoch]).permutation(self.num_prompts)
            self._perm_epoch = epoch
        return self._perm

    def next(self, count: int) -> list[int]:
        """The next `count` prompt indices (the global batch; ranks slice their share)."""
        out = []
        for i in range(self.position, self.position + count):
            out.append(int(self._permutation(i // self.num_prompts)[i % self.num_prompts]))
        self.position += count
        return out
