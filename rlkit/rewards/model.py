"""A neural reward model: a transformers sequence-classification model with one output (`reward.model`).

It reads the conversation the policy saw (its chat messages) plus the response as the assistant turn,
rendered with the reward model's own chat template and tokenizer (the plain fallback template when it
has none), and its score is the head's output at the last real token. Padding is located from the
attention mask, not from the pad id: tokenizers whose pad token is their EOS token (SmolLM2, Qwen)
would otherwise make transformers' own pooling skip a response's final EOS.

Scoring is batched (`reward.model_batch_size` sequences per forward), without gradients, on the
learner's device; on a GPU the model is moved there for scoring and back to the CPU afterwards, so
it holds no GPU memory while the learner trains. The score enters the reward with weight
`reward.model_weight` and is logged as `reward/model`.
"""

from __future__ import annotations

import logging

import torch
from torch import Tensor

from rlkit.models import load_tokenizer, resolve_model

log = logging.getLogger(__name__)


class RewardModel:
    def __init__(self, path: str, *, device="cpu", dtype=torch.float32, batch_size: int = 16):
        from transformers import AutoModelForSequenceClassification

        directory, gguf_file = resolve_model(path)
        kwargs = {"gguf_file": gguf_file} if gguf_file else {}
        model = AutoModelForSequenceClassification.from_pretrained(directory, dtype=dtype, **kwargs)
        if model.config.num_labels != 1 or not hasattr(model, "score"):
            raise ValueError(
                f"reward.model={path!r} must be a sequence-classification model with one output and a "
                f"`score` head (got num_labels={model.config.num_labels}, {type(model).__name__})"
            )
        self.model = model.eval().requires_grad_(False)
        self.tokenizer = load_tokenizer(path)
        self.device = torch.device(device)
        self.batch_size = batch_size
        self.max_tokens = getattr(model.config, "max_position_embeddings", None)

    def render(self, messages: list[dict], response: str) -> list[int]:
        """Token ids of the conversation `messages` followed by `response` as the assistant turn."""
        conversation = [*messages, {"role": "assistant", "content": response}]
        text = self.tokenizer.apply_chat_template(conversation, tokenize=False)
        ids = self.tokenizer(text, add_special_tokens=False).input_ids
        if self.max_tokens is not None and len(ids) > self.max_tokens:
            ids = ids[-self.max_tokens :]  # keep the response end, which the score reads
        return ids

    @torch.no_grad()
    def score(self, messages: list[list[dict]], responses: list[str]) -> Tensor:
        """[N] float32 scores of N (conversation, response) pairs."""
        sequences = [self.render(m, r) for m, r in zip(messages, responses)]
        on_gpu = self.device.type != "cpu"
        if on_gpu:
            self.model.to(self.device)
        try:
            out = [
                self._score_batch(sequences[s : s + self.batch_size])
                for s in range(0, len(sequences), self.batch_size)
            ]
        finally:
            if on_gpu:
                self.model.to("cpu")
                torch.cuda.empty_cache()
        return torch.cat(out) if out else torch.zeros(0)

    def _score_batch(self, sequences: list[list[int]]) -> Tensor:
        width = max(len(s) for s in sequences)
        ids = torch.zeros((len(sequences), width), dtype=torch.long)
        mask = torch.zeros((len(sequences), width), dtype=torch.long)
        for i, s in enumerate(sequences):  # right padding: the last real token is at len - 1
            ids[i, : len(s)] = torch.tensor(s)
            mask[i, : len(s)] = 1
        ids, mask = ids.to(self.device), mask.to(self.device)
        backbone = getattr(self.model, self.model.base_model_prefix)
        hidden = backbone(input_ids=ids, attention_mask=mask).last_hidden_state
        last = hidden[torch.arange(len(sequences), device=self.device), mask.sum(-1) - 1]
        return self.model.score(last)[:, 0].float().cpu()
