"""The learner: scores rollouts and updates the policy. The only module that touches accelerate / FSDP.

One `update(batch)` call, top to bottom:

1. check that the batch carries every field the configured loss needs (before any collective, so a
   misconfigured run fails with a message on every rank instead of hanging inside an all-reduce);
2. recompute old log-probs if the update is off-policy (more than one optimizer step per batch);
3. split the local rows into `mini_batches` mini-batches and pack each into token-budget
   micro-batches; all-reduce the micro-batch counts (MAX) and the loss denominators (SUM) once;
4. for each epoch and mini-batch: run every micro-batch (padding ones included, so each rank runs the
   same number), assemble the loss from `rlkit.algos` with the GLOBAL denominators, backward,
   then clip, step and schedule.

Why global denominators: `token-mean` over a mini-batch split into micro-batches on several ranks is
sum(loss * mask) / (tokens in the whole mini-batch on all ranks). Each micro-batch therefore divides
its own sum by that global count (never by its own token count), and the data-parallel wrapper's
gradient averaging over ranks is undone by multiplying by the world size. The accumulated gradient
then equals the gradient of the full-batch loss (tests/learner/test_gradients.py checks it).

The loss of one mini-batch (every term aggregated with `loss_agg_mode` over the global mini-batch)::

    loss =            agg(policy_loss(logp, old_logp, A) * is_weights)   policy_loss, clip_low, clip_high, dual_clip
         + kl_coef  * agg(kl_estimate(logp, ref_logp, kl_estimator))      kl_coef, kl_estimator (needs ref_logprobs)
         + rollout_kl_coef * agg(rollout_kl(logp, rollout_logp))          rollout_kl_coef, rollout_kl_estimator
         + vf_coef  * agg(losses.value_loss(v, old_v, returns))         value_model, vf_coef, value_clip
         - entropy_coef * agg(entropy)                                    entropy_coef

`old_logp` is the batch's `old_logprobs`, recomputed before the first step when the update is
off-policy (`ppo_epochs * mini_batches > 1`) and absent, else `logp.detach()` (ratio 1, on-policy).

Models: the policy is any causal LM transformers loads (through `rlkit.models`); the frozen
reference (only when `kl_coef > 0`) is a second copy of the initial policy in the compute dtype,
sharded like the policy under FSDP2 (a full copy per rank otherwise); the PPO critic (`value_model=True`) is `AutoModelForTokenClassification` with
`num_labels=1` on the same checkpoint: the transformer backbone plus a freshly initialised
Linear(hidden, 1) "score" head, i.e. one scalar per position.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import math
import pickle
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed.tensor import DTensor

from rlkit.batch import Sequences, TrainBatch
from rlkit.config import LORA_TARGET_MODULES
from rlkit.logprobs import chunked_logprobs, logprobs_from_logits
from rlkit.metrics import MetricMerger

log = logging.getLogger(__name__)

POLICY_LOSSES = ("ppo_clip", "gspo", "cispo")
AGG_MODES = ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm")
KL_ESTIMATORS = ("k1", "abs", "k2", "k3")
SCHEDULERS_FILE = "schedulers.json"  # LR scheduler states, in a checkpoint's state/ directory
LR_SCHEDULES = ("constant", "cosine")
DTYPES = ("float32", "bfloat16")
STRATEGIES = ("auto", "fsdp2", "ddp")

# Module names that wrappers (FSDP1, DDP, torch.compile, activation checkpointing) insert into
# parameter names; the rollout engines expect the plain transformers names.
_WRAPPER_PARTS = ("_fsdp_wrapped_module", "_orig_mod", "_checkpoint_wrapped_module")


@dataclass
class LearnerConfig:
    """Everything the learner needs; the trainer fills it from the Hydra config."""

    model_path: str = "smollm2-135m"
    """Policy checkpoint: a local HF directory, a hub id, or a short name `rlkit.models` resolves."""
    dtype: str = "bfloat16"
    """"bfloat16": fp32 master weights with bf16 mixed precision on CUDA or under FSDP2 (else fp32 on CPU); "float32": fp32 throughout."""
    strategy: str = "auto"
    """Data-parallel wrapper with several processes: "auto" (FSDP2 on CUDA, DDP on CPU), "fsdp2" or "ddp"."""
    gradient_checkpointing: bool = False
    """Recompute activations in the backward pass (transformers' gradient checkpointing, non-reentrant)."""
    lora_rank: int = 0
    """LoRA adapters of this rank (peft) instead of full fine-tuning; 0 = off (see rlkit.lora)."""
    lora_alpha: float = 32.0
    lora_dropout: float = 0.0
    lora_target_modules: tuple[str, ...] = LORA_TARGET_MODULES
    lr: float = 1e-6
    """Peak AdamW learning rate."""
    weight_decay: float = 0.0
    """AdamW decoupled weight decay."""
    betas: tuple[float, float] = (0.9, 0.999)
    """AdamW betas."""
    warmup_steps: int = 0
    """Linear warm-up from 0 to `lr` over this many optimizer steps."""
    total_steps: int = 1000
    """Optimizer steps of the whole run (length of the cosine schedule)."""
    lr_schedule: str = "constant"
    """After warm-up: "constant" or "cosine" (decays to 0 at `total_steps`)."""
    max_grad_norm: float | None = 1.0
    """Clip the global gradient norm to this value; None = no clipping (the norm is still logged)."""
    max_tokens_per_microbatch: int = 8192
    """Token budget of one micro-batch: real tokens when `pack_sequences`, else rows x (longest prompt + longest response)."""
    pack_sequences: bool = False
    """Run each micro-batch as one padding-free sequence (position ids restart per row, attention stays in the row).

    Off by default: transformers' sdpa / eager attention then build a dense [L, L] block-diagonal mask,
    so attention costs O(L^2) over the whole micro-batch; measured slower on CPU (README)."""
    logprob_chunk_tokens: int = 512
    """Positions per chunk through the LM head for log-probs / entropy (memory ~ chunk x vocab); 0 = full logits."""
    temperature: float = 1.0
    """Sampling temperature of the rollout engine; log-probs are log_softmax(logits / temperature)."""
    top_k: int = 0
    """Rollout top-k (0 = off): log-probs are over the tokens top-k keeps, renormalised, as the engines sample."""
    top_p: float = 1.0
    """Rollout top-p (1 = off): log-probs are over the tokens top-p keeps (after top-k), renormalised."""
    policy_loss: str = "ppo_clip"
    """"ppo_clip", "gspo" or "cispo" (see rlkit.algos.losses)."""
    clip_low: float = 0.2
    """Lower ratio clip epsilon (ratio >= 1 - clip_low)."""
    clip_high: float = 0.2
    """Upper ratio clip epsilon (ratio <= 1 + clip_high); 0.28 is DAPO's clip-higher."""
    dual_clip: float | None = None
    """Dual-clip constant c > 1 for negative advantages (ppo_clip only); None = off."""
    loss_agg_mode: str = "token-mean"
    """How per-token losses become a scalar: one of AGG_MODES, over the whole global mini-batch."""
    norm_len: int | None = None
    """Length constant of "seq-mean-token-sum-norm" (Dr. GRPO); None = the mini-batch's padded response length."""
    kl_coef: float = 0.0
    """Weight of the KL loss to the frozen reference; > 0 loads the reference model."""
    load_reference: bool = False
    """Load the frozen reference even when `kl_coef == 0` (e.g. KL in the reward: `forward(ref=True)`)."""
    kl_estimator: str = "k3"
    """KL estimator of the KL loss: "k1", "abs", "k2" or "k3"."""
    rollout_kl_coef: float = 0.0
    """Weight of the rollout-KL loss (learner vs rollout engine log-probs); needs `rollout_logprobs`."""
    rollout_kl_estimator: str = "k2"
    """Estimator of the rollout-KL loss."""
    entropy_coef: float = 0.0
    """Weight of the entropy bonus (subtracted from the loss); 0 computes entropy for logging only."""
    value_model: bool = False
    """Load a PPO critic (backbone + scalar head) and train it with the clipped value loss."""
    vf_coef: float = 0.5
    """Weight of the value loss (only with `value_model`)."""
    value_clip: float | None = 0.2
    """Value-prediction clip range around the rollout-time values; None = unclipped value loss."""
    ppo_epochs: int = 1
    """Passes over each rollout batch."""
    mini_batches: int = 1
    """Optimizer steps per pass (each rank splits its rows into this many mini-batches)."""
    seed: int = 0
    """Seed for model initialisation (the critic's head) and torch RNG."""
    collective_timeout_s: float = 600.0
    """Timeout of every collective of the process group (torch.distributed's init_process_group timeout)."""

    def __post_init__(self):
        def choice(key, valid):
            value = getattr(self, key)
            if value not in valid:
                raise ValueError(f"learner.{key}={value!r} is not valid; choose one of {list(valid)}")

        choice("dtype", DTYPES)
        if self.strategy not in STRATEGIES:  # a trainer key: named as such
            raise ValueError(
                f"trainer.strategy={self.strategy!r} is not valid; choose one of {list(STRATEGIES)}"
            )
        choice("lr_schedule", LR_SCHEDULES)
        choice("policy_loss", POLICY_LOSSES)
        choice("loss_agg_mode", AGG_MODES)
        choice("kl_estimator", KL_ESTIMATORS)
        choice("rollout_kl_estimator", KL_ESTIMATORS)
        positive = ("temperature", "max_tokens_per_microbatch", "ppo_epochs", "mini_batches", "total_steps")
        for key in positive:
            if not getattr(self, key) > 0:
                raise ValueError(f"learner.{key}={getattr(self, key)!r} must be > 0")
        for key in (
            "lr",
            "weight_decay",
            "warmup_steps",
            "kl_coef",
            "rollout_kl_coef",
            "entropy_coef",
            "vf_coef",
        ):
            if getattr(self, key) < 0:
                raise ValueError(f"learner.{key}={getattr(self, key)!r} must be >= 0")
        if self.dual_clip is not None and not self.dual_clip > 1:
            raise ValueError(f"learner.dual_clip={self.dual_clip!r} must be > 1 (or None = off)")
        if self.logprob_chunk_tokens < 0 or self.top_k < 0 or not 0 < self.top_p <= 1:
            raise ValueError(
                f"learner.logprob_chunk_tokens={self.logprob_chunk_tokens!r} and learner.top_k={self.top_k!r} "
                f"must be >= 0, learner.top_p={self.top_p!r} in (0, 1]"
            )
        if self.norm_len is not None and not self.norm_len > 0:
            raise ValueError(f"learner.norm_len={self.norm_len!r} must be > 0 (or None)")
        self.betas = tuple(self.betas)

    @property
    def off_policy(self) -> bool:
        """More than one optimizer step per rollout batch: the policy moves away from the sampler."""
        return self.ppo_epochs * self.mini_batches > 1


@dataclass
class LogProbs:
    """What `Learner.forward` returns; each tensor [N, T] float32, detached, 0 where response_mask is False."""

    logprobs: Tensor | None = None
    ref_logprobs: Tensor | None = None
    values: Tensor | None = None
    entropy: Tensor | None = None


# ---------------------------------------------------------------------------------------------
# Pure helpers (tested on their own)


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


def clean_param_name(name: str) -> str:
    """Strip wrapper components (FSDP1, torch.compile, activation checkpointing, a leading DDP `module.`)."""
    parts = [p for p in name.split(".") if p not in _WRAPPER_PARTS]
    while parts and parts[0] == "module":
        parts = parts[1:]
    return ".".join(parts)


def iter_full_parameters(module: torch.nn.Module) -> Iterator[tuple[str, Tensor]]:
    """(clean HF name, full tensor) for every parameter and persistent buffer, one at a time.

    FSDP2 parameters are DTensor shards: `full_tensor()` all-gathers just that one parameter, so peak
    extra memory is one full parameter, never the whole model. Every rank must consume the iterator in
    lock-step (each gather is a collective). Tied parameters are yielded once, under their first name.
    """
    from torch.distributed.tensor import DTensor

    seen: set[int] = set()
    persistent_buffers = {
        f"{mod_name}.{b}" if mod_name else b
        for mod_name, mod in module.named_modules()
        for b in mod._buffers
        if b not in mod._non_persistent_buffers_set
    }
    named = list(module.named_parameters()) + [
        (n, b) for n, b in module.named_buffers() if n in persistent_buffers
    ]
    for name, tensor in named:
        if id(tensor) in seen:
            continue
        seen.add(id(tensor))
        full = tensor.full_tensor() if isinstance(tensor, DTensor) else tensor
        yield clean_param_name(name), full.detach()


# ---------------------------------------------------------------------------------------------
# Micro-batches


@dataclass(frozen=True)
class _Micro:
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


def _lengths(prompt_mask: Tensor, response_mask: Tensor) -> tuple[list[int], list[int]]:
    """Host lists of each row's prompt length and response extent (last True + 1). One host sync."""
    cols = torch.arange(1, response_mask.shape[1] + 1, device=response_mask.device)
    extent = (response_mask.bool() * cols).amax(-1) if response_mask.shape[1] else response_mask.sum(-1)
    both = torch.stack([prompt_mask.sum(-1).long(), extent.long()]).cpu()
    return both[0].tolist(), both[1].tolist()


def _microbatches(batch, max_tokens: int, *, skip_empty: bool = False, packed: bool = False) -> list[_Micro]:
    """Pack `batch`'s rows into token-budget micro-batches, each trimmed to its own widths.

    With `skip_empty`, rows without a single loss token (zero-std groups, rejected samples) are left
    out: every loss term is a masked sum, so they would add exactly zero to the loss and its gradient,
    at the full price of a forward and backward pass.
    """
    plens, rlens = _lengths(batch.prompt_mask, batch.response_mask)
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
        micros.append(_Micro(batch.select(idx), idx, p, t, tuple((plens[i], rlens[i]) for i in rows)))
    return micros


@dataclass(frozen=True)
class _Inputs:
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

    def scatter(self, values: Tensor) -> Tensor:
        """[M] -> [n, t], 0 at positions not scored (differentiable, out of place)."""
        out = torch.zeros(self.shape, dtype=values.dtype, device=values.device)
        return out.index_put((self.rows, self.pos), values)


def _model_inputs(m: _Micro, *, packed: bool, device) -> _Inputs:
    """Padded: [n, P+t] with left-padded prompts (as today's HF generate numbers them). Packed: one
    [1, sum of real tokens] sequence, position ids restarting at 0 on each row and no attention mask,
    so transformers' mask builders (sdpa, eager, flex) and flash-attention's varlen path keep attention
    inside each row (they detect the restarts in position_ids)."""
    p_max, t, b = m.prompt_len, m.response_len, m.batch
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
    else:
        ids, starts = [], []
        offset = 0
        for i, ((p, _), r) in enumerate(zip(m.lens, scored)):
            p = max(1, p)
            ids += [b.prompt_ids[i, -p:], b.response_ids[i, :r]]
            starts.append(offset + p - 1)
            offset += p + r
        input_ids = torch.cat(ids).to(device)[None]
        attn = None
        lengths = torch.tensor([max(1, p) + r for (p, _), r in zip(m.lens, scored)])
        pos_ids = torch.cat([torch.arange(n) for n in lengths]).to(device)[None]
        cols = torch.tensor(starts)[rows] + pos
        take = torch.arange(len(cols))
    dev = dict(device=device)
    return _Inputs(
        input_ids,
        attn,
        pos_ids,
        cols.to(**dev),
        take.to(**dev),
        targets,
        rows.to(**dev),
        pos.to(**dev),
        (len(scored), t),
    )


def _chunkable_head(model) -> torch.nn.Module | None:
    """The LM head if logits are exactly hidden @ head.weight.T (Llama, Qwen2, Mistral ...), else None.

    Soft-capped (Gemma 2/3), scaled (Cohere, Granite) or biased heads fall back to full logits.
    """
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    cfg = getattr(model, "config", None)
    special = [
        getattr(cfg, "final_logit_softcapping", None),
        getattr(cfg, "logit_scale", None),
        getattr(cfg, "logits_scaling", None),
    ]
    if (
        not isinstance(head, torch.nn.Linear)
        or head.bias is not None
        or any(x not in (None, 1, 1.0) for x in special)
    ):
        return None
    return head


def _padding_micro(batch) -> _Micro:
    """A padding micro-batch built generically: every field of `batch`'s first row, loss mask 0."""
    return _Micro(batch.padding_like(1), None, 1, 1, ((1, 1),))


# ---------------------------------------------------------------------------------------------


def resolve_strategy(strategy: str, *, cuda: bool, world_size: int) -> str:
    """The data-parallel wrapper actually used: "fsdp2", "ddp" or "none".

    "auto" is FSDP2 on CUDA and DDP over gloo for several CPU processes. One process has nothing to
    shard or average: it runs plain whatever was asked (as accelerate does with one GPU).
    """
    if strategy not in STRATEGIES:
        raise ValueError(f"trainer.strategy={strategy!r} is not valid; choose one of {list(STRATEGIES)}")
    if world_size == 1:
        return "none"
    if strategy == "auto":
        return "fsdp2" if cuda else "ddp"
    return strategy


def make_accelerator(cfg: LearnerConfig):
    """The accelerate `Accelerator` of `cfg.strategy` (see `resolve_strategy`), on CUDA or on CPU over gloo.

    FSDP2 is accelerate's own: `prepare`, `clip_grad_norm_`, `get_state_dict`, `save_state` and
    `load_state` run its FSDP2 branches (DTensor shards, DCP sharded checkpoints) on CPU as on CUDA.
    accelerate 1.15 turns its FSDP plugin on only for multi-accelerator process groups, never for
    MULTI_CPU (`AcceleratorState.__init__`). On CPU `_enable_fsdp_on_cpu` therefore runs the same three
    assignments accelerate runs for a GPU group; nothing else is patched. What differs from CUDA:
    the collectives go over gloo instead of NCCL, and bf16 runs on the CPU's bf16 kernels.

    Precision: `dtype="bfloat16"` is fp32 master weights with bf16 compute (FSDP2's
    MixedPrecisionPolicy; autocast under DDP on CUDA). On CPU without FSDP2 it stays fp32.
    """
    from datetime import timedelta

    from accelerate import Accelerator, FullyShardedDataParallelPlugin, PartialState

    cuda = torch.cuda.is_available()
    # PartialState joins the process group (gloo on CPU) and is shared by the Accelerator built below.
    # A bounded wait in every collective: a stopped rank must not hang the others (gloo and NCCL honour it).
    timeout = timedelta(seconds=cfg.collective_timeout_s)
    world_size = PartialState(cpu=not cuda, timeout=timeout).num_processes
    strategy = resolve_strategy(cfg.strategy, cuda=cuda, world_size=world_size)
    bf16 = cfg.dtype == "bfloat16" and (cuda or strategy == "fsdp2")
    mixed_precision = "bf16" if bf16 else "no"
    if strategy != "fsdp2":
        return Accelerator(cpu=not cuda, mixed_precision=mixed_precision)
    plugin = FullyShardedDataParallelPlugin(
        fsdp_version=2,
        auto_wrap_policy="transformer_based_wrap",
        reshard_after_forward=True,
        state_dict_type="SHARDED_STATE_DICT",
    )
    acc = Accelerator(cpu=not cuda, mixed_precision=mixed_precision, fsdp_plugin=plugin)
    if not cuda:
        _enable_fsdp_on_cpu(acc, plugin)
    if not acc.is_fsdp2:
        raise RuntimeError(f"trainer.strategy=fsdp2 but accelerate chose {acc.distributed_type}")
    return acc


def _enable_fsdp_on_cpu(acc, plugin) -> None:
    """Switch a MULTI_CPU accelerate state to FSDP, as `AcceleratorState.__init__` does for GPU groups.

    The state is shared by every Accelerator/AcceleratorState/PartialState of the process, so the
    Accelerator's `prepare`, `clip_grad_norm_`, `get_state_dict`, `save_state` and `load_state` all
    take their FSDP2 branches from here on.
    """
    from accelerate.state import PartialState
    from accelerate.utils import DistributedType

    state = acc.state
    if state.distributed_type not in (
        DistributedType.MULTI_CPU,
        DistributedType.FSDP,
    ):  # FSDP: a 2nd Accelerator
        raise RuntimeError(f"FSDP2 on CPU expects accelerate's MULTI_CPU state, got {state.distributed_type}")
    if state.mixed_precision != "no":
        plugin.set_mixed_precision(state.mixed_precision)
    state.fsdp_plugin = plugin
    state.distributed_type = DistributedType.FSDP
    PartialState._shared_state["distributed_type"] = DistributedType.FSDP


def _load_causal_lm(path: str, dtype: torch.dtype, device):
    from rlkit.models import load_causal_lm

    return load_causal_lm(path, dtype=dtype, device=device)


def _load_value_model(path: str):
    """Backbone + Linear(hidden, 1) head: transformers' token-classification model with one label."""
    from transformers import AutoModelForTokenClassification

    from rlkit.models import resolve_model

    resolved, gguf_file = resolve_model(path)
    kwargs = {"gguf_file": gguf_file} if gguf_file else {}
    model = AutoModelForTokenClassification.from_pretrained(
        resolved, num_labels=1, dtype=torch.float32, **kwargs
    )
    model.config.use_cache = False
    return model


def _plain(x: Tensor) -> Tensor:
    """A DTensor (e.g. the grad norm of FSDP2-sharded grads) as its full value; other tensors unchanged."""
    from torch.distributed.tensor import DTensor

    return x.full_tensor() if isinstance(x, DTensor) else x


def _lr_lambda(cfg: LearnerConfig):
    def fn(step: int) -> float:
        if step < cfg.warmup_steps:
            return (step + 1) / (cfg.warmup_steps + 1)
        if cfg.lr_schedule == "constant":
            return 1.0
        progress = min(1.0, (step - cfg.warmup_steps) / max(1, cfg.total_steps - cfg.warmup_steps))
        return 0.5 * (1.0 + math.cos(math.pi * progress))

    return fn


class Learner:
    """Owns the policy (and optional reference / critic), the optimizer and the LR schedule."""

    def __init__(self, cfg: LearnerConfig, accelerator=None):
        from accelerate.utils import set_seed

        self.cfg = cfg
        self.accelerator = accelerator if accelerator is not None else make_accelerator(cfg)
        set_seed(cfg.seed)
        acc = self.accelerator
        self.device = acc.device
        self.world_size = acc.num_processes
        self.compute_dtype = torch.bfloat16 if acc.mixed_precision == "bf16" else torch.float32

        self.lora = cfg.lora_rank > 0
        # fp32 master weights; accelerate casts compute to bf16 under mixed precision. With LoRA only
        # the adapters train: the frozen base is loaded in the compute dtype (no fp32 master copy).
        policy = _load_causal_lm(cfg.model_path, self.compute_dtype if self.lora else torch.float32, "cpu")
        policy.config.use_cache = False
        if cfg.gradient_checkpointing:
            policy.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        if self.lora:
            from rlkit.lora import add_adapters

            policy = add_adapters(policy, cfg)
        self.ref_model = None
        if (cfg.kl_coef > 0 or cfg.load_reference) and not self.lora:  # LoRA: the base, adapters off
            self.ref_model = self._prepare_frozen(_load_causal_lm(cfg.model_path, self.compute_dtype, "cpu"))

        optimizer = self._adamw(policy)
        self.model, self.optimizer = acc.prepare(policy, optimizer)
        # A plain LambdaLR stepped once per optimizer step: accelerate's wrapper steps it
        # num_processes times per call, which assumes a sharded dataloader we do not use.
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, _lr_lambda(cfg))

        self.value_model = self.value_optimizer = self.value_scheduler = None
        if cfg.value_model:
            critic = _load_value_model(cfg.model_path)
            if cfg.gradient_checkpointing:
                critic.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
            self.value_model, self.value_optimizer = acc.prepare(critic, self._adamw(critic))
            self.value_scheduler = torch.optim.lr_scheduler.LambdaLR(self.value_optimizer, _lr_lambda(cfg))
        self.global_step = 0
        self.num_microbatches: list[int] = []
        """Micro-batches run per mini-batch (padding included), appended by every backward pass; for tests."""

    def _prepare_frozen(self, model: torch.nn.Module) -> torch.nn.Module:
        """The frozen reference: under FSDP2 sharded like the policy (each rank holds 1/world of it and
        all-gathers one block at a time in forward), else a full copy on this rank's device."""
        model.requires_grad_(False)  # before sharding: accelerate upcasts only trainable params to fp32
        model.eval()
        if self.accelerator.is_fsdp2:
            from accelerate.utils.fsdp_utils import fsdp2_prepare_model

            return fsdp2_prepare_model(self.accelerator, model)
        return model.to(self.device)

    def _adamw(self, model: torch.nn.Module) -> torch.optim.Optimizer:
        c = self.cfg
        params = [p for p in model.parameters() if p.requires_grad]  # LoRA: the adapters only
        return torch.optim.AdamW(params, lr=c.lr, betas=c.betas, weight_decay=c.weight_decay)

    # -- forward passes ------------------------------------------------------------------------

    def _inputs(self, m: _Micro) -> _Inputs:
        return _model_inputs(m, packed=self.cfg.pack_sequences, device=self.device)

    def _logprobs(
        self, model, m: _Micro, *, entropy: bool, entropy_grad: bool = False
    ) -> tuple[Tensor, Tensor | None]:
        """Response log-probs [n, t] (with grad when enabled) and per-token entropy [n, t] or None.

        Both are under the distribution the engines sample from (temperature, then top-k / top-p
        renormalised, see rlkit.logprobs). The entropy carries a gradient only with `entropy_grad`
        (the entropy bonus); otherwise it is a logged constant and costs no memory in the graph.
        """
        c = self.cfg
        inp = self._inputs(m)
        kw = dict(input_ids=inp.input_ids, attention_mask=inp.attention_mask, position_ids=inp.position_ids)
        trunc = dict(temperature=c.temperature, top_k=c.top_k, top_p=c.top_p)
        head = _chunkable_head(self.accelerator.unwrap_model(model)) if c.logprob_chunk_tokens else None
        if head is not None:
            # Final hidden states only (logits for one position); the head runs chunk by chunk.
            out = model(**kw, output_hidden_states=True, logits_to_keep=1, use_cache=False)
            hidden = out.hidden_states[-1][:, inp.cols].flatten(0, 1)[inp.take]
            weight = head.weight
            if isinstance(weight, DTensor):  # FSDP2 shard outside its module's forward: gather it
                weight = weight.full_tensor()
            logp, ent = chunked_logprobs(
                hidden,
                weight,
                inp.targets,
                chunk_tokens=c.logprob_chunk_tokens,
                entropy_grad=entropy_grad,
                **trunc,
            )
        else:
            out = model(**kw, logits_to_keep=inp.cols, use_cache=False)
            logp, ent = logprobs_from_logits(out.logits.flatten(0, 1)[inp.take], inp.targets, **trunc)
            ent = ent if entropy_grad else ent.detach()
        return inp.scatter(logp), (inp.scatter(ent) if entropy else None)

    def _values(self, m: _Micro) -> Tensor:
        """Critic values [n, t]: the scalar at the position whose hidden state predicts each response token."""
        inp = self._inputs(m)
        out = self.value_model(
            input_ids=inp.input_ids, attention_mask=inp.attention_mask, position_ids=inp.position_ids
        )
        return inp.scatter(out.logits[:, inp.cols, 0].flatten(0, 1)[inp.take].float())

    def _sync_count(self, micros: list[_Micro], batch) -> list[_Micro]:
        """Append padding micro-batches up to the largest count over ranks (one all-reduce MAX)."""
        count = self._all_reduce(torch.tensor([len(micros)], device=self.device), dist.ReduceOp.MAX)
        return micros + [_padding_micro(batch)] * (int(count[0]) - len(micros))

    @torch.no_grad()
    def forward(self, batch, *, policy: bool = True, ref: bool = False, values: bool = False) -> LogProbs:
        """Score a RolloutBatch or TrainBatch (reads prompt_ids/prompt_mask/response_ids/response_mask).

        Returns detached [N, T] float32 tensors, 0 where `response_mask` is False. Every rank
        must call it (FSDP all-gathers inside); `ref=True` needs `kl_coef > 0`, `values=True` needs
        `value_model`.
        """
        if ref and self.ref_model is None and not self.lora:
            raise ValueError(
                "forward(ref=True) needs a reference model; it is loaded only when learner.kl_coef > 0"
            )
        if values and self.value_model is None:
            raise ValueError("forward(values=True) needs a critic; set learner.value_model=true")
        rows = Sequences.of(batch)
        n, t_full = rows.response_ids.shape
        wanted = {"logprobs": policy, "entropy": policy, "ref_logprobs": ref, "values": values}
        out = {k: torch.zeros(n, t_full, device=self.device) for k, on in wanted.items() if on}
        micros = _microbatches(rows, self.cfg.max_tokens_per_microbatch, packed=self.cfg.pack_sequences)
        micros = self._sync_count(micros, rows)
        for m in micros:
            t = m.response_len
            results = {}
            if policy:
                results["logprobs"], results["entropy"] = self._logprobs(self.model, m, entropy=True)
            if ref and self.lora:
                with self.accelerator.unwrap_model(self.model).disable_adapter():
                    results["ref_logprobs"], _ = self._logprobs(self.model, m, entropy=False)
            elif ref:
                results["ref_logprobs"], _ = self._logprobs(self.ref_model, m, entropy=False)
            if values:
                results["values"] = self._values(m)
            if not m.padding:
                keep = m.batch.response_mask[:, :t].to(self.device, torch.bool)
                for k, v in results.items():
                    out[k][m.rows.to(self.device), :t] = torch.where(keep, v.float(), 0.0)
        return LogProbs(**out)

    # -- update --------------------------------------------------------------------------------

    def check_batch(self, batch: TrainBatch) -> None:
        """Raise if the configured loss needs a field the batch lacks (called before any collective)."""
        c = self.cfg
        needs = [
            ("ref_logprobs", c.kl_coef > 0, f"learner.kl_coef={c.kl_coef} > 0"),
            ("rollout_logprobs", c.rollout_kl_coef > 0, f"learner.rollout_kl_coef={c.rollout_kl_coef} > 0"),
            ("values", c.value_model, "learner.value_model=true (value clipping)"),
            ("returns", c.value_model, "learner.value_model=true (value targets)"),
        ]
        for name, needed, why in needs:
            if needed and getattr(batch, name) is None:
                raise ValueError(
                    f"TrainBatch.{name} is None but {why} needs it; fill it in or turn that term off"
                )
        if batch.num_samples == 0:
            raise ValueError(
                "update() got a TrainBatch with 0 rows on this rank; every rank needs at least one row"
            )

    def _all_reduce(self, x: Tensor, op=dist.ReduceOp.SUM) -> Tensor:
        if self.world_size > 1:
            x = x.clone()
            dist.all_reduce(x, op=op)
        return x

    def _plan(
        self, batch: TrainBatch, mini_batches: int
    ) -> list[tuple[list[_Micro], dict[str, Tensor], Tensor]]:
        """Mini-batches of this rank as (micro-batches, global denominators, norm_len).

        All collectives of the update's bookkeeping happen here, once: MAX of the micro-batch counts
        (so every rank runs the same number) and SUM of the loss denominators, per mini-batch.
        """
        c = self.cfg
        chunks = torch.arange(batch.num_samples).tensor_split(mini_batches)
        minis = [batch.select(idx) if len(idx) else None for idx in chunks]
        micros = [
            _microbatches(mb, c.max_tokens_per_microbatch, skip_empty=True, packed=c.pack_sequences)
            if mb is not None
            else []
            for mb in minis
        ]
        local = torch.stack([self._local_counts(mb) for mb in minis])
        sums = self._all_reduce(local)
        local_max = torch.tensor(
            [[len(ms), mb.response_ids.shape[1] if mb is not None else 0] for ms, mb in zip(micros, minis)],
            device=self.device,
        )
        maxes = self._all_reduce(local_max, dist.ReduceOp.MAX).tolist()
        plans = []
        for ms, s, (count, width) in zip(micros, sums, maxes):
            ms = ms + [_padding_micro(batch)] * (max(1, count) - len(ms))
            # seq-mean-token-sum-norm divides by all rows, the seq-mean modes by rows with a loss token.
            rows = s[2] if c.loss_agg_mode == "seq-mean-token-sum-norm" else s[1]
            norm_len = c.norm_len if c.norm_len is not None else max(1, width)
            plans.append((ms, {"num_tokens": s[0], "num_seqs": rows, "processed": s[3]}, norm_len))
        return plans

    def _local_counts(self, mb: TrainBatch | None) -> Tensor:
        """[loss tokens, rows with a loss token, rows, real prompt+response tokens] of a mini-batch."""
        if mb is None:
            return torch.zeros(4, dtype=torch.float64, device=self.device)
        mask = mb.response_mask.bool()
        real = mb.prompt_mask.sum() + mask.sum()
        counts = [mask.sum(), mask.any(-1).sum(), torch.tensor(mask.shape[0]), real]
        return torch.stack([x.to(self.device, torch.float64) for x in counts])

    def update(self, batch: TrainBatch) -> dict[str, Tensor]:
        """`ppo_epochs` passes of `mini_batches` optimizer steps over this rank's rows.

        Returns metrics merged over micro-batches, mini-batches and ranks (token-weighted means;
        max/min keys as max/min), 0-dim float32 CPU tensors; one host sync at the end.
        """
        c = self.cfg
        self.check_batch(batch)
        start = time.perf_counter()
        if c.off_policy and batch.old_logprobs is None:
            # The behaviour policy is the one before the first step; later steps are off-policy against it.
            old = self.forward(batch).logprobs.to(batch.response_ids.device)
            batch = dataclasses.replace(batch, old_logprobs=old)
        plans = self._plan(batch, c.mini_batches)

        merger = MetricMerger()
        step_metrics: list[dict[str, Tensor]] = []
        for _ in range(c.ppo_epochs):
            for plan in plans:
                self._accumulate(plan, merger)
                step_metrics.append(self._optimizer_step())

        result = merger.compute()
        # With no loss token anywhere (every group zero-std), per-token statistics such as the
        # entropy are undefined, not 0: report NaN so a plot shows a gap instead of a fake collapse.
        # The loss parts really are 0.
        tokens = sum(counts["num_tokens"] for _, counts, _ in plans)
        for k, v in result.items():
            if not k.startswith("loss/"):
                result[k] = torch.where(tokens > 0, v, torch.full_like(v, float("nan")))
        for k in step_metrics[0]:
            result[k] = torch.stack([s[k] for s in step_metrics]).mean()
        processed = sum(counts["processed"] for _, counts, _ in plans) * c.ppo_epochs
        result = {k: v.detach().float().cpu() for k, v in result.items()}  # the one host sync
        result["learner/tokens_per_s"] = torch.tensor(float(processed) / (time.perf_counter() - start))
        return result

    def compute_gradients(self, batch: TrainBatch) -> dict[str, Tensor]:
        """Accumulate into `.grad` the gradient of the loss over the whole global batch, no optimizer step.

        The same path as one mini-batch of `update` (for tests and gradient inspection); returns the
        merged metrics. Call `zero_grad()` between calls.
        """
        self.check_batch(batch)
        merger = MetricMerger()
        for plan in self._plan(batch, 1):
            self._accumulate(plan, merger)
        return merger.compute()

    def zero_grad(self) -> None:
        self.optimizer.zero_grad(set_to_none=True)
        if self.value_optimizer is not None:
            self.value_optimizer.zero_grad(set_to_none=True)

    def _accumulate(self, plan, merger: MetricMerger) -> None:
        """Forward + backward over the micro-batches of one mini-batch (all-reduce on the last one only)."""
        micros, counts, norm_len = plan
        self.num_microbatches.append(len(micros))
        for i, m in enumerate(micros):
            with self._no_sync(last=i == len(micros) - 1):
                loss, metrics, weight = self._micro_loss(m, counts, norm_len)
                # DDP / FSDP average gradients over ranks; the loss is already this rank's share of the sum.
                self.accelerator.backward(loss * self.world_size)
            merger.add(metrics, weight)

    def _no_sync(self, last: bool):
        """Skip the gradient all-reduce on all but the last micro-batch of a mini-batch."""
        stack = contextlib.ExitStack()
        if not last:
            for model in (self.model, self.value_model):
                if model is not None:
                    stack.enter_context(self.accelerator.no_sync(model))
        return stack

    def _micro_loss(self, m: _Micro, counts: dict[str, Tensor], norm_len) -> tuple[Tensor, dict, Tensor]:
        """(loss, metrics, token weight) of one micro-batch; the loss is its share of the global loss.

        Every term goes through `losses.aggregate` with the global denominators, so summing the
        micro-batch losses over all micro-batches and ranks gives the loss of the whole mini-batch.
        """
        from rlkit.algos import correction, kl, losses

        c = self.cfg
        t = m.response_len
        b = m.batch

        def tok(name: str) -> Tensor | None:
            v = getattr(b, name)
            return None if v is None else v[:, :t].to(self.device)

        mask = tok("response_mask").bool()
        agg_kw = {"norm_len": norm_len, "num_tokens": counts["num_tokens"], "num_seqs": counts["num_seqs"]}

        def agg(per_token: Tensor) -> Tensor:
            return losses.aggregate(per_token, mask, c.loss_agg_mode, **agg_kw)

        ntok = mask.sum()

        def token_mean(x: Tensor) -> Tensor:
            return torch.where(mask, x.detach().float(), 0.0).sum() / ntok.clamp(min=1)

        logp, entropy = self._logprobs(self.model, m, entropy=True, entropy_grad=c.entropy_coef > 0)
        old = tok("old_logprobs")
        old = logp.detach() if old is None else old
        policy_fn = {"ppo_clip": losses.ppo_clip, "gspo": losses.gspo, "cispo": losses.cispo}[c.policy_loss]
        extra = {"dual_clip": c.dual_clip} if c.policy_loss == "ppo_clip" else {}
        pg, pg_metrics = policy_fn(
            logp, old, tok("advantages"), mask, clip_low=c.clip_low, clip_high=c.clip_high, **extra
        )
        metrics = {f"policy/{k}": v for k, v in pg_metrics.items()}
        is_weights = tok("is_weights")
        parts = {"policy": agg(pg if is_weights is None else pg * is_weights)}
        if c.kl_coef > 0:
            k = kl.kl_estimate(logp, tok("ref_logprobs"), c.kl_estimator)
            parts["kl"] = c.kl_coef * agg(k)
            metrics["kl_ref"] = token_mean(k)
        if c.rollout_kl_coef > 0:
            rk = correction.rollout_kl(logp, tok("rollout_logprobs"), kind=c.rollout_kl_estimator)
            parts["rollout_kl"] = c.rollout_kl_coef * agg(rk)
            metrics["rollout_kl"] = token_mean(rk)
        if c.entropy_coef > 0:
            parts["entropy"] = -c.entropy_coef * agg(entropy)
        metrics["entropy"] = token_mean(entropy)
        if self.value_model is not None:
            v = self._values(m)
            vl, vf_metrics = losses.value_loss(v, tok("values"), tok("returns"), mask, clip=c.value_clip)
            parts["value"] = c.vf_coef * agg(vl)
            metrics.update({f"value/{k}": x for k, x in vf_metrics.items()})
            metrics["value/pred_mean"] = token_mean(v)
        loss = sum(parts.values())

        # Loss parts are shares of a global sum, but the merger takes token-weighted means: report each
        # part scaled by (global tokens / local tokens) so the merged value is the whole mini-batch's loss.
        scale = (counts["num_tokens"] / ntok.clamp(min=1)).float()
        for name, part in parts.items():
            metrics[f"loss/{name}"] = part.detach() * scale
        metrics["loss/total"] = loss.detach() * scale
        return loss, metrics, ntok

    def _optimizer_step(self) -> dict[str, Tensor]:
        """Clip, step, schedule and zero the grads of the policy (and critic); returns grad norms and lr."""
        acc = self.accelerator
        max_norm = self.cfg.max_grad_norm if self.cfg.max_grad_norm is not None else float("inf")
        out = {
            "grad_norm": acc.clip_grad_norm_(self.model.parameters(), max_norm),
            "lr": torch.tensor(self.scheduler.get_last_lr()[0]),
        }
        self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        if self.value_model is not None:
            out["value/grad_norm"] = acc.clip_grad_norm_(self.value_model.parameters(), max_norm)
            self.value_optimizer.step()
            self.value_scheduler.step()
            self.value_optimizer.zero_grad(set_to_none=True)
        self.global_step += 1
        return {k: _plain(v).detach().float().to(self.device) for k, v in out.items()}

    # -- weights and checkpoints ---------------------------------------------------------------

    def named_weights(self) -> Iterator[tuple[str, Tensor]]:
        """(HF name, full tensor) of the policy, one parameter at a time; every rank must iterate it."""
        yield from self._merged(iter_full_parameters(self.accelerator.unwrap_model(self.model)))

    def _merged(self, named: Iterator[tuple[str, Tensor]]) -> Iterator[tuple[str, Tensor]]:
        """With LoRA the engines get merged weights under the base model's names (rlkit.lora)."""
        if not self.lora:
            return named
        from rlkit.lora import merged_weights

        return merged_weights(named, scale=self.cfg.lora_alpha / self.cfg.lora_rank)

    def save_checkpoint(self, directory: str | Path) -> None:
        """`dir/model` (HF format), `dir/value_model` (critic), `dir/state` (optimizer, schedulers, RNG).

        Every rank must call it. Under FSDP2 `dir/state` holds sharded DCP checkpoints (each rank writes
        its own shards) instead of one full copy. Ordering: the main process writes the HF files and the
        unsharded state files alone, so the closing barrier keeps every rank from returning (and, say,
        loading the checkpoint) while the main process is still writing it.
        """
        directory = Path(directory)
        acc = self.accelerator
        for name, model in (("model", self.model), ("value_model", self.value_model)):
            if model is None:
                continue
            if name == "model" and self.lora:
                self._save_lora(directory)
                continue
            state_dict = acc.get_state_dict(model)  # full weights, gathered on the main process
            acc.unwrap_model(model).save_pretrained(
                directory / name, state_dict=state_dict, is_main_process=acc.is_main_process
            )
        acc.save_state(str(directory / "state"))
        if acc.is_main_process:  # plain JSON, not a pickle: loading a checkpoint never runs code
            (directory / "state" / SCHEDULERS_FILE).write_text(json.dumps(self._scheduler_states()))
        acc.wait_for_everyone()

    def _save_lora(self, directory: Path) -> None:
        """`dir/model`: the merged weights as a plain HF checkpoint, as without LoRA; `dir/adapter`: the
        adapter alone in peft's format (PeftModel.from_pretrained). One gathering pass over the
        parameters serves both (every rank iterates it in step)."""
        from rlkit.lora import base_name

        acc, peft_model = self.accelerator, self.accelerator.unwrap_model(self.model)
        adapters: dict[str, Tensor] = {}

        def keep_adapters(named):
            for n, t in named:
                if base_name(n) is None:
                    adapters[n] = t.clone()
                yield n, t

        merged = {n: t.clone() for n, t in self._merged(keep_adapters(iter_full_parameters(peft_model)))}
        peft_model.get_base_model().save_pretrained(
            directory / "model", state_dict=merged, is_main_process=acc.is_main_process
        )
        peft_model.save_pretrained(
            directory / "adapter", state_dict=adapters, is_main_process=acc.is_main_process
        )

    def _scheduler_states(self) -> list[dict]:
        return [s.state_dict() for s in (self.scheduler, self.value_scheduler) if s is not None]

    def load_checkpoint(self, directory: str | Path) -> None:
        """Restore what `save_checkpoint` wrote (weights, optimizer and scheduler states, RNG).

        Nothing in a checkpoint can run code: tensors load with torch's `weights_only=True` (accelerate's
        default), the schedulers from JSON; a checkpoint holding pickled objects (accelerate's
        `custom_checkpoint_*.pkl`, which it unpickles with `weights_only=False`) is refused.
        Every rank must call it, with the world size of the save (RNG states are per rank).
        """
        self.accelerator.wait_for_everyone()  # no rank reads before every rank is done writing
        state = Path(directory) / "state"
        pickled = sorted(p.name for p in state.glob("custom_checkpoint_*.pkl"))
        if pickled:
            raise RuntimeError(
                f"checkpoint {directory} holds pickled objects ({', '.join(pickled)}): rlkit never unpickles "
                "them, since a crafted file would run code on resume. Resume from a checkpoint written by this "
                "version of rlkit, or start a new run (trainer.run_dir=NEW_DIR)."
            )
        try:
            from accelerate.utils import load

            # accelerate loads the RNG states with weights_only=True too, but ignores a failure silently.
            rng = state / f"random_states_{self.accelerator.process_index}.pkl"
            if rng.exists():
                load(rng)
            self.accelerator.load_state(str(state))
        except pickle.UnpicklingError as e:
            raise RuntimeError(
                f"checkpoint {directory}: a file is not plain tensors and was refused by torch.load("
                f"weights_only=True), so it was not run: {str(e).splitlines()[0]}"
            ) from e
        states = json.loads((state / SCHEDULERS_FILE).read_text())
        schedulers = [s for s in (self.scheduler, self.value_scheduler) if s is not None]
        if len(states) != len(schedulers):
            raise RuntimeError(
                f"checkpoint {directory} holds {len(states)} LR scheduler states, this run has "
                f"{len(schedulers)} (algo.value_model differs?)"
            )
        for scheduler, sd in zip(schedulers, states):
            scheduler.load_state_dict(sd)
        self.global_step = self.scheduler.last_epoch


__all__ = [
    "LearnerConfig",
    "Learner",
    "LogProbs",
    "pack_microbatches",
    "position_ids_from_mask",
    "clean_param_name",
    "iter_full_parameters",
    "make_accelerator",
]
