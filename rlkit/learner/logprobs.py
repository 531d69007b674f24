"""Per-token log-probs and entropy through the LM head, chunk by chunk; pure tensor code.

The learner needs, at every response position, `log p(token)` and (for the entropy bonus or its
metric) the entropy of the sampling distribution. Computing them from the full logits
materialises an [positions, V] float32 tensor (5 GB for 8192 positions at Qwen2.5's 151,936-token
vocabulary) plus its softmax, and keeps them for backward. Here the LM head runs on `chunk`
positions at a time, and the backward pass recomputes each chunk's logits instead of storing them,
so the extra memory is O(chunk x V) whatever the number of positions.

The distribution scored is the one the rollout engines sample from (docs/concepts/math.md, "Top-p and
top-k"): `softmax(logits / temperature)`, truncated by top-k then top-p exactly as transformers'
warpers and vLLM do, renormalised over the kept tokens; the target token always counts as kept,
so a token the engine sampled never gets log-prob -inf here.

Gradients (z = logits / temperature, p the truncated softmax, zero outside the kept set K):
  d logp_t / dz = onehot(t) - p
  d H / dz_k    = -p_k (log p_k + H)          (H = -sum_K p log p)
The kept set is piecewise constant in z, so it contributes no gradient.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass

import torch
from torch import Tensor

from rlkit.learner.positions import packed_positions
from rlkit.learner.routing import set_routes
from rlkit.vision import has_3d_positions, image_kwargs

# FSDP2 warns, once per process, when a wrapped module's output holds a view (an in-place op on it would skip the
# module's pre-backward hook). With `output_hidden_states` (the chunked head below) the embedding's output,
# hidden_states[0], is such a view; rlkit reads only the last hidden state and writes into no output, so the
# warning says nothing about this forward and would only reach every rank's console.
warnings.filterwarnings(
    "ignore", message=r"FSDP2-wrapped module \(.*\) returned a view tensor", category=UserWarning
)


@dataclass
class LogProbs:
    """What `Learner.forward` returns; each tensor [N, T] float32, detached, 0 where response_mask is False."""

    logprobs: Tensor | None = None
    ref_logprobs: Tensor | None = None
    teacher_logprobs: Tensor | None = None
    values: Tensor | None = None
    entropy: Tensor | None = None


BF16_HEAD_MIN_POSITIONS = 256
"""Under bf16 compute the chunked head multiplies in bf16 only from this many positions per call: the bf16
copy of its weight (one pass over V x H per call) costs more than the bf16 matmuls save below it. Measured
on the project's 2-core CPU for SmolLM2's 49,152 x 576 head, forward + backward: fp32 / bf16 0.107 / 0.131 s
at 64 positions, 0.142 / 0.146 at 128, 0.267 / 0.213 at 256, 0.959 / 0.727 at 1024."""


def truncation_mask(z: Tensor, top_k: int = 0, top_p: float = 1.0) -> Tensor | None:
    """bool [..., V]: the tokens top-k then top-p keep from scaled logits z; None when nothing is cut.

    Same rule as transformers' TopKLogitsWarper / TopPLogitsWarper (generate's order) and vLLM's
    sampler: top-k keeps every token at least as large as the k-th largest (ties kept); top-p then
    sorts the top-k-renormalised probabilities ascending and drops the tokens whose cumulative
    probability is <= 1 - top_p, always keeping the most probable one.
    """
    if top_k <= 0 and top_p >= 1.0:
        return None
    keep = torch.ones_like(z, dtype=torch.bool)
    if 0 < top_k < z.shape[-1]:
        kth = torch.topk(z, top_k, dim=-1).values[..., -1:]
        keep = z >= kth
    if top_p < 1.0:
        masked = z.masked_fill(~keep, float("-inf"))
        sorted_z, order = torch.sort(masked, dim=-1)
        cum = sorted_z.softmax(-1).cumsum(-1)
        drop_sorted = cum <= 1 - top_p
        drop_sorted[..., -1] = False
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        keep = keep & ~drop
    return keep


def _chunk_stats(z: Tensor, targets: Tensor, top_k: int, top_p: float):
    """(logp_target [c], log-probs over V [c, V] (0 outside K), probs [c, V], entropy [c]) of one chunk."""
    keep = truncation_mask(z, top_k, top_p)
    if keep is not None:
        keep = keep.scatter(-1, targets[:, None], True)  # the sampled token always counts as kept
        z = z.masked_fill(~keep, float("-inf"))
    lse = torch.logsumexp(z, -1, keepdim=True)
    logp_all = z - lse
    if keep is not None:
        logp_all = logp_all.masked_fill(~keep, 0.0)  # so p * log p is 0, not nan, outside K
    p = torch.exp(z - lse)
    entropy = -(p * logp_all).sum(-1)
    return logp_all.gather(-1, targets[:, None]).squeeze(-1), logp_all, p, entropy


def _chunk_logits(h: Tensor, weight: Tensor, targets: Tensor, temperature: float, top_k: int, top_p: float):
    """A chunk's scaled logits z [c, V] float32 (-inf outside the kept set) and whether anything was
    truncated. z is a fresh buffer: the caller may overwrite it."""
    z = (h.to(weight.dtype) @ weight.t()).float()  # the matmul at the head's (compute) dtype, the rest fp32
    z = z.div_(temperature) if temperature != 1.0 else z
    keep = truncation_mask(z, top_k, top_p)
    if keep is not None:
        keep.scatter_(-1, targets[:, None], True)  # the sampled token always counts as kept
        z.masked_fill_(~keep, float("-inf"))
    return z, keep is not None


def _probs_and_entropy(z: Tensor, lse: Tensor, truncated: bool) -> tuple[Tensor, Tensor]:
    """p = softmax [c, V] (a new buffer) and entropy [c]; z becomes log p in place (0 outside K)."""
    z.sub_(lse)
    p = torch.exp(z)
    if truncated:
        z.nan_to_num_(neginf=0.0)  # log p = -inf outside K; p is 0 there, so p * log p must be 0
    return p, -torch.bmm(p[:, None, :], z[:, :, None]).view(-1)  # row-wise dot, no [c, V] temporary


class _ChunkedHead(torch.autograd.Function):
    """(hidden [M, H], weight [V, H]) -> (logp [M], entropy [M] or [0]) with O(chunk x V) memory both ways.

    At most two [chunk, V] float32 buffers live at once (the logits, turned in place into log-probs
    and then into the gradient, and the probabilities); only the logsumexp [M] is kept for backward.
    Without an entropy gradient the backward needs one buffer: dL/dz = gl * (onehot - exp(z - lse)).
    """

    @staticmethod
    def forward(
        ctx, hidden, weight, targets, temperature, chunk, top_k, top_p, entropy_grad, matmul_dtype, entropy
    ):
        ctx.set_materialize_grads(False)  # an unused output's gradient is None, not a tensor of zeros
        ctx.weight_dtype = weight.dtype
        weight = weight.to(matmul_dtype)  # a bf16 copy under bf16 compute, else weight itself
        m = hidden.shape[0]
        logp = torch.empty(m, dtype=torch.float32, device=hidden.device)
        lses = torch.empty(m, dtype=torch.float32, device=hidden.device)
        ent = torch.empty(m if entropy else 0, dtype=torch.float32, device=hidden.device)
        for s in range(0, m, chunk):
            t = targets[s : s + chunk]
            z, truncated = _chunk_logits(hidden[s : s + chunk], weight, t, temperature, top_k, top_p)
            lse = torch.logsumexp(z, -1, keepdim=True)
            lses[s : s + chunk] = lse.squeeze(-1)
            logp[s : s + chunk] = z.gather(-1, t[:, None]).squeeze(-1) - lse.squeeze(-1)
            if entropy:
                _, ent[s : s + chunk] = _probs_and_entropy(z, lse, truncated)
        ctx.save_for_backward(hidden, weight, targets, lses)  # weight at the matmul dtype
        ctx.args = (temperature, chunk, top_k, top_p)
        if not (entropy and entropy_grad):
            ctx.mark_non_differentiable(ent)
        return logp, ent

    @staticmethod
    def backward(ctx, grad_logp, grad_ent):
        hidden, weight, targets, lses = ctx.saved_tensors
        temperature, chunk, top_k, top_p = ctx.args
        grad_h = torch.zeros_like(hidden) if ctx.needs_input_grad[0] else None
        grad_w = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device)  # accumulated in fp32
        for s in range(0, hidden.shape[0], chunk):
            t, lse = targets[s : s + chunk], lses[s : s + chunk, None]
            gl = grad_logp[s : s + chunk, None] if grad_logp is not None else None
            h_c = hidden[s : s + chunk].to(weight.dtype)
            z, truncated = _chunk_logits(h_c, weight, t, temperature, top_k, top_p)
            # dL/dz = gl * (onehot - p) - ge * p * (log p + H), built in z's buffer.
            if grad_ent is not None:
                p, ent = _probs_and_entropy(z, lse, truncated)  # z is now log p
                g = z.add_(ent[:, None]).mul_(-grad_ent[s : s + chunk, None])
                g = (g.sub_(gl) if gl is not None else g).mul_(p)
                del p
            else:  # -gl * p, with p = exp(z - lse) in place (0 outside the kept set)
                g = z.sub_(lse).exp_().mul_(-gl)
            if gl is not None:
                g.scatter_add_(-1, t[:, None], gl)
            g = g.div_(temperature) if temperature != 1.0 else g
            if grad_h is not None:
                grad_h[s : s + chunk] = (g.to(weight.dtype) @ weight).to(hidden.dtype)
            if weight.dtype == torch.float32:
                grad_w.addmm_(g.t(), h_c.float())
            else:  # the product at the matmul dtype (as autocast's backward), the sum over chunks in fp32
                grad_w.add_(g.to(weight.dtype).t() @ h_c)
        grad_w = grad_w.to(ctx.weight_dtype) if ctx.needs_input_grad[1] else None
        return grad_h, grad_w, None, None, None, None, None, None, None, None


def chunked_logprobs(
    hidden: Tensor,
    weight: Tensor,
    targets: Tensor,
    *,
    temperature: float = 1.0,
    chunk_tokens: int = 1024,
    top_k: int = 0,
    top_p: float = 1.0,
    entropy_grad: bool = False,
    matmul_dtype: torch.dtype | None = None,
    entropy: bool = True,
) -> tuple[Tensor, Tensor | None]:
    """Log-prob of `targets` and entropy under the (truncated) sampling distribution, chunked.

    hidden [M, H] final hidden states (after the last norm) at the positions that predict
    `targets` [M] long; weight [V, H] the LM head (bias-free, no soft-capping). Returns (logp [M],
    entropy [M]) float32. Gradients flow to hidden and weight through logp, and through the entropy
    only with `entropy_grad` (else the entropy is a constant: logging only).

    `matmul_dtype` (default: the weight's) is the dtype the head's three matmuls run in (logits, the
    gradients of hidden and weight); bf16 compute passes bfloat16 for an fp32 master weight, as autocast
    would for the model's own head. Softmax, log-probs and entropy are fp32 whatever it is, and the
    weight's gradient is summed over chunks in fp32 and returned in the weight's dtype. With
    `entropy=False` the entropy is not computed (None): one exp pass per chunk fewer.
    """
    if chunk_tokens <= 0:
        raise ValueError(f"chunk_tokens={chunk_tokens} must be > 0")
    logp, ent = _ChunkedHead.apply(
        hidden, weight, targets, float(temperature), int(chunk_tokens), int(top_k), float(top_p), entropy_grad,
        matmul_dtype or weight.dtype, entropy,
    )  # fmt: skip
    return logp, (ent if entropy else None)


def logprobs_from_logits(
    logits: Tensor, targets: Tensor, *, temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0
) -> tuple[Tensor, Tensor]:
    """Unchunked reference: (logp [...], entropy [...]) from full logits [..., V], same distribution."""
    z = logits.float() / temperature
    shape = targets.shape
    lp, _, _, ent = _chunk_stats(z.reshape(-1, z.shape[-1]), targets.reshape(-1), top_k, top_p)
    return lp.view(shape), ent.view(shape)


def chunkable_head(model) -> torch.nn.Module | None:
    """The LM head if logits are exactly hidden @ head.weight.T (Llama, Qwen2, Mistral ...), else None.

    Soft-capped (Gemma 2/3), scaled (Cohere, Granite) or biased heads fall back to full logits.
    """
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    cfg = getattr(model, "config", None)
    if cfg is not None and hasattr(
        cfg, "get_text_config"
    ):  # a VL model's head settings sit in its text config
        cfg = cfg.get_text_config(decoder=True)
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


def score(model, unwrapped, inp, *, temperature: float, top_k: int, top_p: float, chunk_tokens: int,
          entropy: bool, entropy_grad: bool = False, compute_dtype: torch.dtype = torch.float32,
          ) -> tuple[Tensor, Tensor | None]:  # fmt: skip
    """Response log-probs [n, t] (with grad when enabled) and per-token entropy [n, t] or None of one
    micro-batch's `inp` (rlkit.learner.batching.Inputs), under the distribution the engines sample from
    (temperature, then top-k / top-p renormalised).

    With `chunk_tokens` and a plain linear head, the model returns only its final hidden states and the
    head runs chunk by chunk; else full logits at the scored positions. The entropy carries a gradient only
    with `entropy_grad` (the entropy bonus); otherwise it is a logged constant and costs no graph memory.
    `compute_dtype` bfloat16 (bf16 compute) runs the chunked head's matmuls in bf16, as the model's own
    layers run under autocast or FSDP2's mixed precision, from BF16_HEAD_MIN_POSITIONS positions on; an fp32
    compute dtype keeps the weight's dtype.
    """
    from torch.distributed.tensor import DTensor

    kw = dict(input_ids=inp.input_ids, attention_mask=inp.attention_mask, position_ids=inp.position_ids)
    # routing replay: the routers take the engine's experts (a model without hooks, e.g. the reference, ignores it)
    set_routes(unwrapped, inp.routes)
    vision = image_kwargs(unwrapped, inp.images, inp.input_ids)
    kw.update(vision)
    if has_3d_positions(unwrapped) and inp.lengths is not None:
        # Qwen's 3D rotary positions, packed: each row's as the model computes them for the row alone.
        kw["position_ids"] = packed_positions(unwrapped, inp.input_ids, inp.lengths, inp.images)
    elif vision and has_3d_positions(unwrapped):
        # Padded: the model computes them from the mask and the grid sizes, for the left-padded row as for the
        # row alone (and as the engine's prefill does).
        kw["position_ids"] = None
    trunc = dict(temperature=temperature, top_k=top_k, top_p=top_p)
    head = chunkable_head(unwrapped) if chunk_tokens else None
    if head is not None:
        # Final hidden states only (logits for one position); the head runs chunk by chunk.
        out = model(**kw, output_hidden_states=True, logits_to_keep=1, use_cache=False)
        hidden = out.hidden_states[-1][:, inp.cols].flatten(0, 1)[inp.take]
        weight = head.weight
        if isinstance(weight, DTensor):  # FSDP2 shard outside its module's forward: gather it
            weight = weight.full_tensor()
        bf16 = compute_dtype != torch.float32 and hidden.shape[0] >= BF16_HEAD_MIN_POSITIONS
        mm = compute_dtype if bf16 else None
        logp, ent = chunked_logprobs(
            hidden, weight, inp.targets, chunk_tokens=chunk_tokens, entropy_grad=entropy_grad, matmul_dtype=mm,
            entropy=entropy or entropy_grad, **trunc,
        )  # fmt: skip
    else:
        out = model(**kw, logits_to_keep=inp.cols, use_cache=False)
        logp, ent = logprobs_from_logits(out.logits.flatten(0, 1)[inp.take], inp.targets, **trunc)
        ent = ent if entropy_grad else ent.detach()
    return inp.scatter(logp), (inp.scatter(ent) if entropy else None)


def critic_values(critic, inp) -> Tensor:
    """Critic values [n, t]: the scalar at the position whose hidden state predicts each response token."""
    out = critic(input_ids=inp.input_ids, attention_mask=inp.attention_mask, position_ids=inp.position_ids)
    return inp.scatter(out.logits[:, inp.cols, 0].flatten(0, 1)[inp.take].float())
