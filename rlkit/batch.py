"""The typed batches that cross module borders: RolloutBatch (an engine's output), ScoredBatch (the rollout
half's output, with its policy version), Sequences (what a forward pass reads) and TrainBatch (the learner's
input).

All four are frozen dataclasses: a stage that wants to change a field builds a new batch with
`dataclasses.replace`, so a tensor that was logged is never modified behind the logger's back.

Layout of one sample (row) in every batch::

    prompt_ids   [P]  left-padded   (pad ... pad p0 p1 ... pk)
    response_ids [T]  right-padded  (r0 r1 ... EOS pad ... pad)

so `torch.cat([prompt_ids, response_ids], 1)` is the sequence the model saw, and response token t sits at
position P + t; its log-prob is read from the logits at position P + t - 1.

Rows with images (vision-language models) carry them in `images`: one `Images` (or None for a text-only row)
per row, a tuple beside the tensors. A prompt's `Images` is built once, when the prompt is rendered, and the G
rows of its group share the one object; `select`, `padding_like` and `to` carry it like a tensor field. The
prompt ids already hold the image placeholders expanded to the processor's count of image tokens, so engine
and learner see the same ids.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import torch
from torch import Tensor

FINISH_REASONS = ("stop", "length")
NO_VERSION = -1
"""`token_versions` at padding and at environment (observation) tokens: no policy sampled them."""
# RolloutBatch.stats that add up when batches are stacked: generated tokens, seconds, and the sums of the
# finished sequences' lengths and squared lengths (prompt + response: what generation's FLOPs need).
SUMMED_STATS = ("gen_tokens", "gen_seconds", "gen_seq_tokens", "gen_seq_tokens_sq")


def generation_stats(prompt_mask: Tensor, sequence_mask: Tensor, generated: Tensor, seconds: float) -> dict:
    """The statistics every engine reports for a batch: `gen_tokens` (the `generated` mask's sum),
    `gen_seconds`, `gen_tokens_per_s`, and `gen_seq_tokens` / `gen_seq_tokens_sq`, the sums of each finished
    sequence's length (prompt + every response token in `sequence_mask`) and of its square."""
    lengths = (prompt_mask.sum(-1) + sequence_mask.sum(-1)).double()
    tokens = float(generated.sum())
    return {
        "gen_tokens": tokens,
        "gen_seconds": seconds,
        "gen_tokens_per_s": tokens / max(seconds, 1e-9),
        "gen_seq_tokens": float(lengths.sum()),
        "gen_seq_tokens_sq": float(lengths.square().sum()),
    }


@dataclass(frozen=True, eq=False)
class Images:
    """One prompt's images, decoded and processed once when the prompt is rendered.

    `pictures` are what vLLM's own processor and the samples log take; `tensors` are the model processor's
    outputs for them (for instance `pixel_values` and `image_grid_thw` for Qwen's VL models,
    `pixel_values` and `pixel_attention_mask` for Idefics3), what the HF engine and the learner's forward
    take. `digest` names the pictures' content (sha256 over their pixels): the prefix-cache key and the
    samples log's id."""

    pictures: tuple
    """PIL images (RGB), in the order of their placeholders in the prompt."""
    tensors: dict[str, Tensor]
    """The processor's image tensors for this prompt alone, on CPU, first dimension per image or per patch."""
    digest: str
    """sha256 hex digest of the pictures' sizes and pixels."""

    def to(self, device: torch.device | str) -> Images:
        return dataclasses.replace(self, tensors={k: v.to(device) for k, v in self.tensors.items()})


ROW_TUPLES = ("images",)
"""Per-row fields that are tuples, not tensors (one entry per row); `_RowOps` indexes them with the rows."""


def _check_rows(obj, n: int) -> None:
    """Every tensor field and per-row tuple has `n` rows (RolloutBatch checks that its per-token fields share T
    on its own)."""
    for f in dataclasses.fields(obj):
        v = getattr(obj, f.name)
        if isinstance(v, Tensor):
            rows = v.shape[0]
        elif f.name in ROW_TUPLES and v is not None:
            rows = len(v)
        else:
            continue
        if rows != n:
            raise ValueError(f"{type(obj).__name__}.{f.name} has {rows} rows, expected {n}")


def check_routes(routes: Tensor | None, prompt_ids: Tensor, response_ids: Tensor) -> None:
    """`routed_experts` is None or [N, P + T, layers, k] for prompt_ids [N, P] and response_ids [N, T]."""
    if routes is None:
        return
    n, width = prompt_ids.shape[0], prompt_ids.shape[1] + response_ids.shape[1]
    if routes.dim() != 4 or tuple(routes.shape[:2]) != (n, width):
        raise ValueError(
            f"routed_experts has shape {tuple(routes.shape)}, expected [{n}, {width}, layers, k]"
        )


def pad_routes(routes: Tensor, left: int, right: int) -> Tensor:
    """`routes` [N, P + T, L, k] re-padded like the tokens: `left` columns before the prompt, `right` after the
    response (-1 there: no route)."""
    return torch.nn.functional.pad(routes, (0, 0, 0, 0, left, right), value=-1) if left or right else routes


def select_rows(rows: tuple, index: Tensor | slice) -> tuple:
    """Entries `index` of a per-row tuple (a slice, or a tensor of row indices or a bool mask)."""
    if isinstance(index, slice):
        return rows[index]
    if index.dtype == torch.bool:
        index = index.nonzero().flatten()
    return tuple(rows[i] for i in index.tolist())


class _RowOps:
    """Row operations shared by the batches: they work over every tensor field, so a field added to
    a batch is carried by `select`, `padding_like` and `to` without touching them."""

    @property
    def num_samples(self) -> int:
        return self.response_ids.shape[0]

    def tensor_fields(self) -> dict[str, Tensor]:
        """All tensor-valued fields by name (None fields left out)."""
        return {
            f.name: getattr(self, f.name)
            for f in dataclasses.fields(self)
            if isinstance(getattr(self, f.name), Tensor)
        }

    def row_tuples(self) -> dict[str, tuple]:
        """The per-row tuple fields that are set (`images` on rows with images)."""
        return {k: getattr(self, k) for k in ROW_TUPLES if getattr(self, k, None) is not None}

    def select(self, index: Tensor | list[int] | slice):
        """Rows `index` of every tensor field and per-row tuple (a new batch; the original is untouched)."""
        if isinstance(index, list):
            index = torch.tensor(index, dtype=torch.long, device=self.response_ids.device)
        picked = {k: v[index] for k, v in self.tensor_fields().items()}
        picked.update({k: select_rows(v, index) for k, v in self.row_tuples().items()})
        return dataclasses.replace(self, **picked)

    def padding_like(self, rows: int = 1):
        """A padding micro-batch: `rows` copies of this batch's first row in every field, loss mask 0.

        Built from the real fields (not a hard-coded list), so it carries whatever per-token
        fields the real micro-batches carry, with finite values and no loss contribution.
        """
        idx = torch.zeros(rows, dtype=torch.long, device=self.response_ids.device)
        pad = self.select(idx)
        return dataclasses.replace(pad, response_mask=torch.zeros_like(pad.response_mask))

    def to(self, device: torch.device | str):
        moved = {k: v.to(device) for k, v in self.tensor_fields().items()}
        moved.update(
            {k: tuple(x if x is None else x.to(device) for x in v) for k, v in self.row_tuples().items()}
        )
        return dataclasses.replace(self, **moved)


@dataclass(frozen=True)
class Sequences(_RowOps):
    """Just the token tensors a forward pass reads; `Sequences.of(batch)` views a RolloutBatch or a
    TrainBatch this way, and `select` takes any subset of rows (no group-size constraint)."""

    prompt_ids: Tensor
    prompt_mask: Tensor
    response_ids: Tensor
    response_mask: Tensor
    images: tuple[Images | None, ...] | None = None
    """Per row, the prompt's images (None for a text-only row); None when no row has any."""
    routed_experts: Tensor | None = None
    """[N, P + T, L, k], the engine's routes the learner replays (RolloutBatch.routed_experts)."""

    def __post_init__(self):
        _check_rows(self, self.response_ids.shape[0])
        check_routes(self.routed_experts, self.prompt_ids, self.response_ids)

    @classmethod
    def of(cls, batch) -> Sequences:
        return cls(
            batch.prompt_ids, batch.prompt_mask, batch.response_ids, batch.response_mask, batch.images,
            getattr(batch, "routed_experts", None),
        )  # fmt: skip


@dataclass(frozen=True)
class RolloutBatch:
    """What a rollout engine returns: N = B * G samples, the G samples of a prompt contiguous."""

    prompt_ids: Tensor
    """[N, P] long, left-padded prompt tokens."""
    prompt_mask: Tensor
    """[N, P] bool, True on real prompt tokens."""
    response_ids: Tensor
    """[N, T] long, right-padded sampled tokens."""
    response_mask: Tensor
    """[N, T] bool, True on every token the model sampled, up to and including EOS/stop; in multi-turn
    episodes observation tokens inside the response are False (context, never trained)."""
    rollout_logprobs: Tensor
    """[N, T] float32, log-prob of each sampled token under the distribution it was sampled from
    (temperature/top-p/top-k applied); 0 at padding."""
    finish_reasons: tuple[str, ...]
    """Per sample: "stop" (EOS or a stop string) or "length" (hit max_new_tokens)."""
    group_index: Tensor
    """[N] long, index of the prompt (group) each sample belongs to; groups contiguous."""
    group_size: int
    """G, samples per prompt."""
    response_texts: tuple[str, ...] = ()
    """Decoded responses (special tokens skipped), for the reward functions."""
    stats: dict[str, float] = field(default_factory=dict)
    """Engine statistics, e.g. `gen_tokens`, `gen_seconds`, `gen_tokens_per_s`."""
    token_versions: Tensor | None = None
    """[N, T] long, the policy version whose weights sampled each token (with in-flight weight updates a
    row can hold several); NO_VERSION (-1) at padding and at environment tokens. Every engine fills it;
    None only in a batch built by hand without it."""
    images: tuple[Images | None, ...] | None = None
    """Per row, the prompt's images (the group's rows share one object); None when no row has any."""
    routed_experts: Tensor | None = None
    """[N, P + T, L, k] int16, the experts the engine's MoE layers routed each token to (prompt and response
    positions, laid out as `cat([prompt_ids, response_ids], 1)`; -1 where the engine routed nothing: padding and
    the last response token): what the learner's routers
    replay (`algo.routing_replay`); None when off."""

    def __post_init__(self):
        n = self.response_ids.shape[0]
        _check_rows(self, n)
        check_routes(self.routed_experts, self.prompt_ids, self.response_ids)
        shapes = [self.response_mask.shape, self.rollout_logprobs.shape]
        if self.token_versions is not None:
            shapes.append(self.token_versions.shape)
        if any(s != self.response_ids.shape for s in shapes):
            raise ValueError(
                "response_ids, response_mask, rollout_logprobs and token_versions must share shape [N, T]"
            )
        if len(self.finish_reasons) != n:
            raise ValueError(f"finish_reasons has {len(self.finish_reasons)} entries, expected {n}")
        if self.group_size < 1 or n % self.group_size:
            raise ValueError(f"group_size={self.group_size} does not divide N={n}")

    @property
    def num_samples(self) -> int:
        return self.response_ids.shape[0]

    @property
    def response_lengths(self) -> Tensor:
        """[N] long, generated tokens per sample."""
        return self.response_mask.sum(-1)

    def oldest_version(self, default: int) -> int:
        """The oldest policy version that sampled a token of this batch (`default` when no token says)."""
        if self.token_versions is None:
            return default
        labelled = self.token_versions[self.token_versions != NO_VERSION]
        return int(labelled.min()) if labelled.numel() else default


@dataclass(frozen=True)
class TrainBatch(_RowOps):
    """What the learner trains on. Per-token fields are [N, T] over the response positions.

    Optional fields are None when the algorithm does not need them. Generic helpers (`select`,
    `padding_like`) work over every tensor field, so a new field is carried everywhere without
    touching them.
    """

    prompt_ids: Tensor
    """[N, P] long, left-padded."""
    prompt_mask: Tensor
    """[N, P] bool."""
    response_ids: Tensor
    """[N, T] long, right-padded."""
    response_mask: Tensor
    """[N, T] bool, the loss mask: generated tokens that count (zero-std groups, rejected samples
    and padding rows removed)."""
    advantages: Tensor
    """[N, T] float."""
    old_logprobs: Tensor | None = None
    """[N, T] learner log-probs before the update (PPO ratio denominator); None = on-policy, the
    detached current log-probs serve."""
    ref_logprobs: Tensor | None = None
    """[N, T] reference-model log-probs (KL loss)."""
    rollout_logprobs: Tensor | None = None
    """[N, T] engine log-probs (rollout-KL loss)."""
    is_weights: Tensor | None = None
    """[N, T] detached rollout importance-sampling weights (multiply the policy loss)."""
    values: Tensor | None = None
    """[N, T] value-model predictions at rollout time (PPO value clipping)."""
    returns: Tensor | None = None
    """[N, T] value targets (PPO)."""
    token_versions: Tensor | None = None
    """[N, T] long, the policy version that sampled each token (RolloutBatch.token_versions)."""
    images: tuple[Images | None, ...] | None = None
    """Per row, the prompt's images (RolloutBatch.images)."""
    routed_experts: Tensor | None = None
    """[N, P + T, L, k] int16, the engine's expert choices per token (RolloutBatch.routed_experts)."""

    def __post_init__(self):
        _check_rows(self, self.response_ids.shape[0])
        check_routes(self.routed_experts, self.prompt_ids, self.response_ids)


@dataclass(frozen=True)
class ScoredBatch:
    """This rank's share of a step's scored groups (whole groups, contiguous)."""

    rollout: RolloutBatch
    rewards: Tensor
    """[N] float32 total reward (weighted reward functions + overlong penalty): what advantages use."""
    correct: Tensor
    """[N] float32 1/0: the task's verdict on each sample (`accuracy`, the refill filter's `accuracy`)."""
    per_fn: dict[str, Tensor]
    """[N] float32 per reward term: each reward function's raw value, and `overlong` when it is on."""
    errors: int
    """Reward calls that raised, hung or returned a non-number on this rank (all generation batches)."""
    timeouts: int
    """Of those, the ones that timed out."""
    stats: dict[str, float]
    """`dynamic/gen_batches`, `dynamic/kept_frac`, `dynamic/shortfall_groups` (global, refill mode only)."""
    policy_version: int
    """The oldest policy version that sampled a token of these samples (`RolloutBatch.oldest_version`): the
    trainer step whose weights generated them, or began to when weights were updated in flight."""
    env_stats: dict[str, Tensor] = dataclasses.field(default_factory=dict)
    """[N] float32 per episode: `turns`, `tool_calls` (logged as env/<name>, means per episode)."""
    env_errors: int = 0
    """Environment steps that raised or hung on this rank (their episodes score 0)."""
    env_timeouts: int = 0
    """Of those, the ones that timed out."""
    tasks: dict[str, Tensor] = dataclasses.field(default_factory=dict)
    """[N] float32 1/0 per task name: which samples come from that task, when the data has a `task` column
    (reasoning-gym); logged as reward/<task>, accuracy/<task>, task_samples/<task>."""
