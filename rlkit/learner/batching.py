"""How the learner lays rows out: token-budget micro-batches (padded or packed), the model inputs of one
micro-batch and where each scored token's prediction sits, padding micro-batches, and the mini-batch plan
with its global loss denominators."""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor

from rlkit.batch import Sequences, TrainBatch
from rlkit.collectives import all_reduce
from rlkit.learner.positions import packed_positions
from rlkit.models import stateful_layers
from rlkit.vision import has_3d_positions

log = logging.getLogger(__name__)


def packing(requested: bool, model) -> bool:
    """Whether the learner packs rows (`trainer.pack_sequences`) for this transformers model: only where a packed
    row sees what it sees alone. Not where layers carry state from one position to the next
    (`rlkit.models.stateful_layers`: transformers' kernels for them take no row boundaries, so a packed row would
    start from the previous row's state), nor where two short rows packed as `model_inputs` lays them out score
    differently from each row alone (an attention path that misses the restarting positions: gpt-oss's eager
    attention with sinks in transformers 5.19). The padded layout is exact for both. Said once, at INFO, naming the
    model type. Vision-language models pack by the same rules (each row's pictures and positions its own,
    `model_inputs` and `rlkit.learner.positions`)."""
    if not requested:
        return False
    stateful = stateful_layers(model.config)
    if stateful:
        why = (
            f"its {'/'.join(stateful)} layers carry state from one position to the next and transformers' kernels "
            "for them take no row boundaries (a packed row would start from the previous row's state)"
        )
    elif (gap := packed_gap(model)) > PACKED_GAP:
        why = f"two rows packed score differently from each row alone (mean |dlogp| {gap:.2g})"
    else:
        return True
    log.info(
        "trainer.pack_sequences=true: packing is off for this model (%s): %s; rows are padded instead",
        getattr(model.config, "model_type", type(model).__name__), why,
    )  # fmt: skip
    return False


def check_sharded_images(images, *, sharded: bool) -> None:
    """Under FSDP2 a VL model's vision tower is sharded: every rank must run it in every micro-batch, so a row
    without images (which skips the tower) would leave the ranks in different collectives. Refused before any
    collective, naming the keys."""
    if sharded and (images is None or any(x is None for x in images)):
        raise ValueError(
            "trainer.strategy=fsdp2 with data.image_key: a batch holds rows without images, which would skip the "
            "sharded vision tower on some ranks (the ranks' collectives then differ); give every row an image, or "
            "train without FSDP2 (trainer.strategy=ddp)"
        )


# packed_gap's bound: fp32 and bf16 rounding stay far below it (a model that sees the other row: 0.3-1).
PACKED_GAP = 0.05


@torch.no_grad()
def packed_gap(model) -> float:
    """Mean |dlogp| over the second of two 6-token rows between running them packed (one sequence, positions
    restarting, no attention mask: `model_inputs`) and running it alone."""
    vocab = model.config.get_text_config(decoder=True).vocab_size
    ids = torch.randint(0, vocab, (1, 12), generator=torch.Generator().manual_seed(0))
    device = next(model.parameters()).device
    ids = ids.to(device)
    positions = torch.arange(6, device=device).repeat(2)[None]
    if has_3d_positions(model):  # Qwen's VL models: a packed sequence's positions are [4, 1, total]
        positions = packed_positions(model, ids, (6, 6), None)
    packed = model(input_ids=ids, position_ids=positions, use_cache=False).logits[0, 6:].float()
    alone = model(input_ids=ids[:, 6:], position_ids=positions[..., :6], use_cache=False).logits[0].float()
    return float((packed.log_softmax(-1) - alone.log_softmax(-1)).abs().mean())


def position_ids_from_mask(attention_mask: Tensor) -> Tensor:
    """[N, L] -> [N, L] long: cumsum(mask) - 1 clipped at 0, as HF `generate` numbers left-padded rows."""
    return (attention_mask.long().cumsum(-1) - 1).clamp(min=0)


def pack_microbatches(
    prompt_lens: list[int], response_lens: list[int], max_tokens: int, *, padded: bool = True
) -> list[list[int]]:
    """Greedy packing of rows into micro-batches whose size fits `max_tokens`.

    The size is what the model sees: with `padded`, rows x (longest prompt + longest response) (the
    tensor after trimming); without, the real tokens, sum of (prompt + response) (one packed
    sequence). Rows are taken longest first and appended to the current bin while the size stays
    within budget; a row longer than the budget gets a bin of its own.
    Returns lists of row indices (each sorted ascending).
    """
    order = sorted(range(len(prompt_lens)), key=lambda i: prompt_lens[i] + response_lens[i], reverse=True)
    bins: list[list[int]] = []
    cur: list[int] = []
    max_p = max_r = real = 0
    for i in order:
        p, r = max(max_p, prompt_lens[i]), max(max_r, response_lens[i])
        size = (len(cur) + 1) * (p + r) if padded else real + prompt_lens[i] + response_lens[i]
        if cur and size > max_tokens:
            bins.append(sorted(cur))
            cur, p, r, real = [], prompt_lens[i], response_lens[i], 0
        cur.append(i)
        max_p, max_r, real = p, r, real + prompt_lens[i] + response_lens[i]
    if cur:
        bins.append(sorted(cur))
    return bins


@dataclass(frozen=True)
class Micro:
    """One micro-batch: its rows (a TrainBatch or Sequences), where they came from, and the trimmed widths."""

    batch: TrainBatch | Sequences
    rows: Tensor | None
    """Row indices into the (mini-)batch; None for a padding micro-batch."""
    prompt_len: int
    response_len: int
    lens: tuple[tuple[int, int], ...]
    """Each row's (prompt length, response extent), host ints: the packed layout and the scored positions."""

    @property
    def padding(self) -> bool:
        return self.rows is None

    def token_counts(self, *, packed: bool) -> tuple[int, int]:
        """(real tokens, tokens the model runs on): real = each row's prompt + response extent (0 for a
        padding micro-batch); run = the packed sequence's length, or rows x (prompt width + response width)."""
        real = 0 if self.padding else sum(p + r for p, r in self.lens)
        if packed:
            return real, sum(max(1, p) + max(1, r) for p, r in self.lens)
        return real, len(self.lens) * (self.prompt_len + self.response_len)


def row_lengths(prompt_mask: Tensor, response_mask: Tensor) -> tuple[list[int], list[int]]:
    """Host lists of each row's prompt length and response extent (last True + 1). One host sync."""
    cols = torch.arange(1, response_mask.shape[1] + 1, device=response_mask.device)
    extent = (response_mask.bool() * cols).amax(-1) if response_mask.shape[1] else response_mask.sum(-1)
    both = torch.stack([prompt_mask.sum(-1).long(), extent.long()]).cpu()
    return both[0].tolist(), both[1].tolist()


def microbatches(batch, max_tokens: int, *, skip_empty: bool = False, packed: bool = False) -> list[Micro]:
    """Pack `batch`'s rows into token-budget micro-batches, each trimmed to its own widths.

    With `skip_empty`, rows without a single loss token (zero-std groups, rejected samples) are left
    out: every loss term is a masked sum, so they would add exactly zero to the loss and its gradient,
    at the full price of a forward and backward pass.
    """
    plens, rlens = row_lengths(batch.prompt_mask, batch.response_mask)
    keep = [i for i, r in enumerate(rlens) if r > 0 or not skip_empty]
    micros = []
    bins = pack_microbatches(
        [plens[i] for i in keep], [rlens[i] for i in keep], max_tokens, padded=not packed
    )
    for b in bins:
        rows = [keep[j] for j in b]
        idx = torch.tensor(rows, dtype=torch.long, device=batch.response_ids.device)
        # At least one prompt column (the logit of response token 0 sits there) and one response column.
        p = max(1, max(plens[i] for i in rows))
        t = max(1, max(rlens[i] for i in rows))
        micros.append(Micro(batch.select(idx), idx, p, t, tuple((plens[i], rlens[i]) for i in rows)))
    return micros


@dataclass(frozen=True)
class Inputs:
    """Model inputs of one micro-batch and where each scored token's prediction sits.

    The model output at columns `cols` of every row, flattened, then indexed by `take`, gives one
    prediction per scored token [M], in the order of `targets`; `rows` / `pos` place it in the
    micro-batch's [n, t] response grid (every position before the row's response extent, at least one).
    """

    input_ids: Tensor
    attention_mask: Tensor | None
    position_ids: Tensor
    cols: Tensor
    take: Tensor
    targets: Tensor
    rows: Tensor
    pos: Tensor
    shape: tuple[int, int]
    routes: Tensor | None = None
    """[rows, columns, L, k]: the engine's expert choices at every input position (routing replay), or None."""
    images: tuple | None = None
    """Each row's rlkit.batch.Images or None, in row order (packed: the order of the rows in the sequence), or None
    when no row has any: `rlkit.vision.image_kwargs` of the forward."""
    lengths: tuple[int, ...] | None = None
    """Packed layout: each row's length in the sequence, in order (Qwen VL's 3D positions are computed per row,
    `rlkit.learner.positions`); None for the padded layout."""

    def scatter(self, values: Tensor) -> Tensor:
        """[M] -> [n, t], 0 at positions not scored (differentiable, out of place)."""
        out = torch.zeros(self.shape, dtype=values.dtype, device=values.device)
        return out.index_put((self.rows, self.pos), values)


def model_inputs(m: Micro, *, packed: bool, device) -> Inputs:
    """Padded: [n, P+t] with left-padded prompts (as today's HF generate numbers them). Packed: one
    [1, sum of real tokens] sequence, position ids restarting at 0 on each row and no attention mask,
    so transformers' mask builders (sdpa, eager, flex) and flash-attention's varlen path keep attention
    inside each row (they detect the restarts in position_ids). Images, in both layouts, are the rows' in row
    order: the model fills its image placeholders in that order (packed, the rows' lengths go along for the models
    whose positions are computed per row from the images, `rlkit.learner.positions`)."""
    p_max, t, b = m.prompt_len, m.response_len, m.batch
    images = b.images if b.images is not None and any(x is not None for x in b.images) else None
    scored = [max(1, r) for _, r in m.lens]
    rows = torch.repeat_interleave(torch.arange(len(scored)), torch.tensor(scored))
    pos = torch.cat([torch.arange(r) for r in scored])
    targets = b.response_ids[:, :t].to(device)[rows.to(device), pos.to(device)]
    if not packed:
        targets_full = b.response_ids[:, :t].to(device)
        input_ids = torch.cat([b.prompt_ids[:, -p_max:].to(device), targets_full], 1)
        prompt_mask = b.prompt_mask[:, -p_max:].to(device, torch.long)
        # The response part of the mask is all ones: responses are right-padded, so under causal
        # attention no real token attends to a padding token after it, and a loss mask with holes
        # (masked tokens inside a response) must not change what the model sees.
        attn = torch.cat([prompt_mask, torch.ones_like(targets_full)], 1)
        cols = torch.arange(p_max - 1, p_max - 1 + t)
        take = rows * t + pos
        pos_ids = position_ids_from_mask(attn)
        routes, lengths = None, None
        if b.routed_experts is not None:
            width = b.prompt_ids.shape[1]
            routes = b.routed_experts[:, width - p_max : width + t].to(device)
    else:
        ids, starts, parts = [], [], []
        offset, width = 0, b.prompt_ids.shape[1]
        for i, ((p, _), r) in enumerate(zip(m.lens, scored)):
            p = max(1, p)
            ids += [b.prompt_ids[i, -p:], b.response_ids[i, :r]]
            if b.routed_experts is not None:
                parts.append(b.routed_experts[i, width - p : width + r])
            starts.append(offset + p - 1)
            offset += p + r
        input_ids = torch.cat(ids).to(device)[None]
        attn = None
        lengths = tuple(max(1, p) + r for (p, _), r in zip(m.lens, scored))
        pos_ids = torch.cat([torch.arange(n) for n in lengths]).to(device)[None]
        cols = torch.tensor(starts)[rows] + pos
        take = torch.arange(len(cols))
        routes = torch.cat(parts).to(device)[None] if parts else None
    dev = dict(device=device)
    return Inputs(
        input_ids,
        attn,
        pos_ids,
        cols.to(**dev),
        take.to(**dev),
        targets,
        rows.to(**dev),
        pos.to(**dev),
        (len(scored), t),
        routes,
        images,
        lengths,
    )


def padding_micro(batch) -> Micro:
    """A padding micro-batch built generically: every field of `batch`'s first row, loss mask 0."""
    return Micro(batch.padding_like(1), None, 1, 1, ((1, 1),))


def local_counts(mb: TrainBatch | None, device) -> Tensor:
    """[loss tokens, rows with a loss token, rows] of a mini-batch."""
    if mb is None:
        return torch.zeros(3, dtype=torch.float64, device=device)
    mask = mb.response_mask.bool()
    counts = [mask.sum(), mask.any(-1).sum(), torch.tensor(mask.shape[0])]
    return torch.stack([x.to(device, torch.float64) for x in counts])


@dataclass(frozen=True)
class MiniBatch:
    """One mini-batch of this rank: its micro-batches (padding ones included, so every rank runs the same
    number) and the loss denominators over the whole global mini-batch."""

    micros: list[Micro]
    num_tokens: Tensor
    """Loss tokens of the global mini-batch (token-mean's denominator)."""
    num_seqs: Tensor
    """Rows of the global mini-batch the sequence means divide by."""
    norm_len: int
    """seq-mean-token-sum-norm's length constant."""


def plan_minibatches(
    batch: TrainBatch, mini_batches: int, *, max_tokens: int, packed: bool, agg_mode: str, norm_len: int | None,
    world: int, device,
) -> list[MiniBatch]:  # fmt: skip
    """This rank's rows split into `mini_batches` mini-batches of token-budget micro-batches.

    All collectives of the update's bookkeeping happen here, once: MAX of the micro-batch counts (so every
    rank runs the same number) and SUM of the loss denominators, per mini-batch.
    """
    chunks = torch.arange(batch.num_samples).tensor_split(mini_batches)
    minis = [batch.select(idx) if len(idx) else None for idx in chunks]
    micros = [
        microbatches(mb, max_tokens, skip_empty=True, packed=packed) if mb is not None else [] for mb in minis
    ]
    local = torch.stack([local_counts(mb, device) for mb in minis])
    sums = all_reduce(local, world, device)
    local_max = torch.tensor(
        [[len(ms), mb.response_ids.shape[1] if mb is not None else 0] for ms, mb in zip(micros, minis)],
        device=device,
    )
    maxes = all_reduce(local_max, world, device, op=dist.ReduceOp.MAX).tolist()
    plans = []
    for ms, s, (count, width) in zip(micros, sums, maxes):
        ms = ms + [padding_micro(batch)] * (max(1, count) - len(ms))
        # seq-mean-token-sum-norm divides by all rows, the seq-mean modes by rows with a loss token.
        rows = s[2] if agg_mode == "seq-mean-token-sum-norm" else s[1]
        plans.append(MiniBatch(ms, s[0], rows, norm_len if norm_len is not None else max(1, width)))
    return plans
