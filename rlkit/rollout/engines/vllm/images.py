"""Prompts with images for vLLM 0.32: the learner's expanded prompt ids in the form vLLM's own processor expands.

rlkit's prompts hold the image placeholders already expanded by the model's HF processor (one placeholder per
image token: the ids the learner trains on). vLLM 0.32 takes a token prompt with `multi_modal_data` and always
expands the placeholders itself (`BaseMultiModalProcessor.apply` -> `_apply_prompt_updates`: the target of each
image, for instance Qwen's single `<|image_pad|>`, is replaced by its full expansion); an already-expanded
prompt would be expanded a second time. So each image's expansion is collapsed back to vLLM's target here
(`to_vllm_prompt`), vLLM expands it again from the same pictures, and the engine checks that the ids vLLM
reports (`RequestOutput.prompt_token_ids`) are the learner's, token for token.

The collapse is per family (`RULES`, by the config's `model_type`); a VL family without one is refused at
start-up (`vl_refusal`). No vllm import here (plain lists of ids)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

from rlkit.weights import exported


@dataclasses.dataclass(frozen=True)
class Rule:
    """How one family's processor expands an image, seen from its tokens: `collapse(ids, tokens)` returns the ids
    with every image's expansion replaced by vLLM's target, and the number of images found."""

    collapse: Callable[[list[int], dict[str, int]], tuple[list[int], int]]
    tokens: tuple[str, ...]
    """The special tokens the rule reads, looked up in the tokenizer once (`image_tokens`)."""


def _runs(ids: list[int], tokens: dict[str, int]) -> tuple[list[int], int]:
    """Qwen2-VL, Qwen2.5-VL, Qwen3-VL: an image is a run of `<|image_pad|>` (vLLM's target: one of them)."""
    pad = tokens["<|image_pad|>"]
    out, count = [], 0
    for i, t in enumerate(ids):
        if t == pad and i > 0 and ids[i - 1] == pad:
            continue
        count += t == pad
        out.append(t)
    return out, count


def _idefics3(ids: list[int], tokens: dict[str, int]) -> tuple[list[int], int]:
    """Idefics3 and SmolVLM: an image is `<fake_token_around_image>` ... `<global-img>` `<image>`*k
    `<fake_token_around_image>` (its tiles with their row/column tags and line breaks first, when the processor
    splits it); vLLM's target is one `<image>`."""
    fake, image, glob = tokens["<fake_token_around_image>"], tokens["<image>"], tokens["<global-img>"]
    out, count, i = [], 0, 0
    while i < len(ids):
        if ids[i] != fake:
            out.append(ids[i])
            i += 1
            continue
        try:
            j = ids.index(glob, i) + 1
        except ValueError:
            raise ValueError(
                f"a <fake_token_around_image> at position {i} opens no <global-img> block"
            ) from None
        while j < len(ids) and ids[j] == image:
            j += 1
        if j >= len(ids) or ids[j] != fake:
            raise ValueError(
                f"the image block opened at position {i} is not closed by <fake_token_around_image>"
            )
        out.append(image)
        count += 1
        i = j + 1
    return out, count


RULES: dict[str, Rule] = {
    "qwen2_vl": Rule(_runs, ("<|image_pad|>",)),
    "qwen2_5_vl": Rule(_runs, ("<|image_pad|>",)),
    "qwen3_vl": Rule(_runs, ("<|image_pad|>",)),
    "qwen3_vl_moe": Rule(_runs, ("<|image_pad|>",)),
    "idefics3": Rule(_idefics3, ("<fake_token_around_image>", "<image>", "<global-img>")),
    "smolvlm": Rule(_idefics3, ("<fake_token_around_image>", "<image>", "<global-img>")),
}


def is_vision_language(config) -> bool:
    """A config with a vision tower (`vision_config`): images are its input."""
    return getattr(config, "vision_config", None) is not None


def image_tokens(config, tokenizer) -> dict[str, int]:
    """{token: id} of the special tokens the family's rule reads; raises naming a token the tokenizer lacks."""
    rule = RULES[config.model_type]
    ids = {}
    for token in rule.tokens:
        tid = tokenizer.convert_tokens_to_ids(token)
        if tid is None or tid == tokenizer.unk_token_id:
            raise ValueError(f"the tokenizer of this {config.model_type} checkpoint has no {token} token")
        ids[token] = tid
    return ids


def vl_refusal(config, directory: str) -> str | None:
    """Why the vLLM engine cannot run this vision-language checkpoint with images, or None (a text model, or a VL
    family with a rule whose HF processor loads: vLLM 0.32 renders images with the checkpoint's own processor,
    loaded by transformers; Qwen's VL processors, for one, need torchvision for their video processor)."""
    if not is_vision_language(config):
        return None
    if config.model_type not in RULES:
        return (
            f"rlkit does not yet pass images to vLLM for model_type {config.model_type!r} (it does for "
            f"{sorted(RULES)}); the HF engine runs it"
        )
    from transformers import AutoProcessor

    try:
        AutoProcessor.from_pretrained(directory)
    except Exception as e:  # ImportError (a missing backend), OSError (no processor files), ValueError
        first = str(e).strip().splitlines()[0] if str(e).strip() else ""
        return (
            f"the checkpoint's image processor does not load here, and vLLM renders images with it "
            f"({type(e).__name__}: {first or e!r})"
        )
    return None


def to_vllm_prompt(ids: list[int], pictures: tuple, config, tokens: dict[str, int], where: str) -> list[int]:
    """`ids` (placeholders expanded by the HF processor) with each image's expansion collapsed to vLLM's target;
    raises naming `where` when the number of images found differs from the number of pictures."""
    collapsed, count = RULES[config.model_type].collapse(list(ids), tokens)
    if count != len(pictures):
        raise ValueError(
            f"{where} holds {count} image placeholder block(s) for {len(pictures)} picture(s): each picture needs "
            f"its placeholders in the prompt, expanded by the model's processor"
        )
    return collapsed


class VLPrompts:
    """One engine's family rule and the ids of its special tokens."""

    def __init__(self, config, tokenizer):
        self.config, self.tokens = config, image_tokens(config, tokenizer)

    def collapse(self, ids: list[int], pictures: tuple, where: str) -> list[int]:
        return to_vllm_prompt(ids, pictures, self.config, self.tokens, where)


def vllm_requests(prompts: list[list[int]], images, vl: VLPrompts | None, **options) -> list[dict]:
    """vLLM token prompts (`vllm.inputs.TokensPrompt` dicts): a prompt with images (rlkit.batch.Images, aligned
    with `prompts`) gets its pictures as `multi_modal_data` and its placeholders collapsed to the form vLLM
    expands. vLLM keys its prefix cache on the pictures' content as well as on the ids (it hashes each picture,
    and the hashes enter the hash of every KV block that covers its placeholders), so two prompts with the same
    ids and different pictures never share a block. `options` go into every prompt (`cache_salt`)."""
    if images is not None and len(images) != len(prompts):
        raise ValueError(f"images has {len(images)} entries for {len(prompts)} prompts")
    requests = []
    for i, ids in enumerate(prompts):
        shown = images[i] if images is not None else None
        if shown is None:
            requests.append({"prompt_token_ids": list(ids), **options})
            continue
        if vl is None:
            raise ValueError(
                f"images[{i}] holds {len(shown.pictures)} picture(s), but the model takes no images"
            )
        requests.append(
            {
                "prompt_token_ids": vl.collapse(ids, shown.pictures, f"prompts[{i}]"),
                "multi_modal_data": {"image": list(shown.pictures)},
                **options,
            }
        )
    return requests


def check_expanded(outputs, prompts: list[list[int]], images) -> None:
    """The ids vLLM expanded from each prompt with images (`RequestOutput.prompt_token_ids`) are the learner's (the
    HF processor's), token for token; raises naming the first difference."""
    for i, (out, ids) in enumerate(zip(outputs, prompts)):
        if images is None or images[i] is None or list(out.prompt_token_ids) == list(ids):
            continue
        got = list(out.prompt_token_ids)
        at = next((k for k, (a, b) in enumerate(zip(got, ids)) if a != b), min(len(got), len(ids)))
        raise ValueError(
            f"prompts[{i}]: vLLM expanded the image placeholders to {len(got)} ids where the model's processor gave "
            f"{len(ids)}, first different at position {at} (vLLM {got[at : at + 4]}, processor "
            f"{list(ids[at : at + 4])}): the engine would sample from another prompt than the learner trains on"
        )


def vision_side(meta) -> set[str]:
    """The manifest names (rlkit.weights.exported) of a weightless vision-language model's vision side: every
    tensor outside its language model (`get_decoder()`) and its output head, i.e. the vision tower and the
    connector. A push may leave these out when the learner freezes them (`model.freeze_vision`)."""
    language = {id(p) for p in meta.get_decoder().parameters()}
    head = meta.get_output_embeddings()
    if head is not None:
        language |= {id(p) for p in head.parameters()}
    return {name for name, tensor in exported(meta) if id(tensor) not in language}
