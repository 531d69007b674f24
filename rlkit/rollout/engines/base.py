"""The rollout-engine protocol shared by the HF and vLLM engines, and the input checks and batch assembly
they share (no engine imports here)."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import torch
from torch import Tensor

from rlkit.batch import NO_VERSION, Images, RolloutBatch, generation_stats

# trainer.inflight_updates: what an engine does with running requests when new weights arrive between two of its
# steps. "off": weights change only between batches; "recompute": running requests recompute their KV cache
# under the new weights; "keep_kv": they keep the KV computed by the old weights (later requests get a fresh
# cache salt). The vLLM engine implements the last two (VLLMEngine.allow_inflight_updates).
INFLIGHT_MODES = ("off", "recompute", "keep_kv")


@dataclass(frozen=True)
class Sampling:
    """How to sample. The same object drives both engines."""

    temperature: float = 1.0
    """Softmax temperature; 0 means greedy."""
    top_p: float = 1.0
    """Nucleus sampling mass (1.0 = off)."""
    top_k: int = 0
    """Keep the k most likely tokens (0 = off)."""
    max_new_tokens: int = 256
    """Generation stops after this many tokens (finish reason "length")."""
    stop: tuple[str, ...] = ()
    """Extra stop strings besides EOS (finish reason "stop"); the stop string is kept in the response."""
    seed: int | None = None
    """Seed for this call; None = the engine's running generator."""
    ignore_eos: bool = False
    """Generate exactly `max_new_tokens` tokens (or up to the model's context), never stopping at EOS or a
    stop string: equal lengths for throughput benchmarks. Every row's finish reason is then "length"."""

    def __post_init__(self):
        if self.temperature < 0:
            raise ValueError(f"sampling.temperature={self.temperature} must be >= 0")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"sampling.top_p={self.top_p} must be in (0, 1]")
        if self.top_k < 0:
            raise ValueError(f"sampling.top_k={self.top_k} must be >= 0 (0 = off)")
        if self.max_new_tokens < 1:
            raise ValueError(f"sampling.max_new_tokens={self.max_new_tokens} must be >= 1")


@runtime_checkable
class RolloutEngine(Protocol):
    """Turns tokenised prompts into groups of sampled completions with per-token log-probs."""

    name: str
    version: int
    """The policy version of the weights held now (labels every sampled token: RolloutBatch.token_versions)."""

    def set_version(self, version: int) -> None:
        """The weights held now are policy version `version` (called by the owner after every push)."""
        ...

    def generate(
        self, prompts: list[list[int]], n: int, sampling: Sampling, images: list[Images | None] | None = None
    ) -> RolloutBatch:
        """Sample `n` completions per prompt; rows of a prompt are contiguous (group index = prompt index).
        `images`, aligned with `prompts`, holds each prompt's images (rlkit.batch.Images; its placeholders
        already expanded in the prompt's ids); the batch's `images` gives each row its prompt's object.
        An engine asked to generate while asleep wakes itself first."""
        ...

    def load_weights(self, named_tensors: Iterable[tuple[str, Tensor]], *, manifest=None) -> int:
        """Replace the engine's weights in place with the learner's (HF/transformers parameter names).

        `manifest` ({name: shape} of everything the stream will hold, rlkit.weights) is checked against the
        engine's own weights before anything is copied; returns the number of tensors loaded."""
        ...

    def sleep(self, *, keep_weights: bool = False) -> None:
        """Free KV cache / weights memory while the learner trains (no-op where unsupported). `keep_weights`: the
        engine generates again before the next push, so its weights must survive the sleep."""
        ...

    def wake(self) -> None:
        """Undo `sleep`."""
        ...

    def close(self) -> None: ...


def check_generate_args(prompts, n: int, context: int | None = None, vocab_size: int | None = None) -> None:
    """Shared input checks of both engines; raise `ValueError` naming the bad argument."""
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ValueError(f"n={n!r} must be an integer >= 1 (samples per prompt)")
    if not prompts:
        raise ValueError("prompts is empty: generate needs at least one tokenised prompt")
    for i, p in enumerate(prompts):
        if len(p) == 0:
            raise ValueError(f"prompts[{i}] is empty: a prompt needs at least one token")
        if context is not None and len(p) >= context:
            raise ValueError(
                f"prompts[{i}] has {len(p)} tokens, but the model's context is {context} "
                f"tokens: no room to generate; shorten the prompt "
                f"(data.max_prompt_tokens) or use a model with a longer context"
            )
        if vocab_size is not None and (min(p) < 0 or max(p) >= vocab_size):
            raise ValueError(f"prompts[{i}] has token ids outside [0, {vocab_size})")


def _pad_routes(prompts, rows, routes: list[torch.Tensor], width: int, steps: int) -> torch.Tensor:
    """Per-sample routes [len(prompt) + len(response), L, k] into [N, width + steps, L, k], aligned with the
    left-padded prompts and right-padded responses (-1 at padding). The engine routes every prompt token and
    every response token but the last (fed back only if generation went on): that one is -1 too."""
    layers, k = routes[0].shape[1:]
    out = torch.full((len(rows), width + steps, layers, k), -1, dtype=torch.int16)
    for i, (p, r, (toks, _, _)) in enumerate(zip(prompts, routes, rows)):
        seen = min(r.shape[0], len(p) + len(toks))
        out[i, width - len(p) : width - len(p) + seen] = r[:seen].to(torch.int16)
    return out


def rows_to_batch(
    prompts: list[list[int]],
    rows: list[tuple[list[int], list[float], str]],
    texts: list[str],
    n: int,
    pad_id: int,
    versions: list[list[int]] | None = None,
    routes: list[torch.Tensor] | None = None,
) -> RolloutBatch:
    """Pad per-sample lists into a RolloutBatch (prompts left-padded, responses right-padded).

    prompts: the N = B * n prompts, one per row (a prompt repeated for its n samples);
    rows: per sample `(response token ids, their log-probs, finish reason)`; texts: decoded responses;
    versions: per sample, the policy version of each response token (NO_VERSION at environment tokens),
    or None (the batch then carries no token versions); routes: per sample, the engine's routed experts
    [prompt + response tokens, MoE layers, k] (`RolloutBatch.routed_experts`), or None.
    """
    num = len(rows)
    width = max(len(p) for p in prompts)
    steps = max(1, max(len(r[0]) for r in rows))
    prompt_ids = torch.full((num, width), pad_id, dtype=torch.long)
    prompt_mask = torch.zeros((num, width), dtype=torch.bool)
    response_ids = torch.full((num, steps), pad_id, dtype=torch.long)
    response_mask = torch.zeros((num, steps), dtype=torch.bool)
    logprobs = torch.zeros((num, steps), dtype=torch.float32)
    token_versions = None if versions is None else torch.full((num, steps), NO_VERSION, dtype=torch.long)
    for i, (p, (toks, lps, _)) in enumerate(zip(prompts, rows)):
        prompt_ids[i, width - len(p) :] = torch.tensor(p)
        prompt_mask[i, width - len(p) :] = True
        response_ids[i, : len(toks)] = torch.tensor(toks, dtype=torch.long)
        response_mask[i, : len(toks)] = True
        logprobs[i, : len(toks)] = torch.tensor(lps, dtype=torch.float32)
        if versions is not None:
            if len(versions[i]) != len(toks):
                raise ValueError(f"row {i}: {len(versions[i])} token versions for {len(toks)} tokens")
            token_versions[i, : len(toks)] = torch.tensor(versions[i], dtype=torch.long)
    return RolloutBatch(
        routed_experts=None if routes is None else _pad_routes(prompts, rows, routes, width, steps),
        prompt_ids=prompt_ids,
        prompt_mask=prompt_mask,
        response_ids=response_ids,
        response_mask=response_mask,
        rollout_logprobs=logprobs,
        finish_reasons=tuple(r[2] for r in rows),
        group_index=torch.arange(num) // n,
        group_size=n,
        response_texts=tuple(texts),
        stats={},
        token_versions=token_versions,
    )


def record_throughput(batch: RolloutBatch, seconds: float) -> RolloutBatch:
    """A new batch with the engine statistics every engine reports (rlkit.batch.generation_stats)."""
    stats = generation_stats(batch.prompt_mask, batch.response_mask, batch.response_mask, seconds)
    return dataclasses.replace(batch, stats={**batch.stats, **stats})  # frozen batches stay as they are
