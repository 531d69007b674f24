"""Whether a push reached the engine whole: by content (`check_engine`: the digest of every tensor the engine holds
against the learner's, or, for tensors the engine rebuilds, their change) and by behaviour (the log-prob probe:
the engine's forward against the learner's on fixed tokens, within a bound by dtype and platform). The push itself
is rlkit.weights'."""

from __future__ import annotations

import hashlib

import torch
from torch import Tensor

from rlkit.batch import Images
from rlkit.digests import tensor_digest, to_host
from rlkit.weights import Export, WeightSyncError

# -- verifying a push: what the engine holds, tensor by tensor ---------------------------------------------


def engine_sources(loads: dict[str, list[str]], origins: dict[str, list[str]]) -> dict[str, list[str]]:
    """{engine tensor: the learner tensors it is built from}, from what a push recorded: `loads` ({checkpoint
    tensor: the engine tensors its loader wrote}, vLLM's own loaders) and `origins` ({checkpoint tensor: the
    learner tensors it is made from})."""
    out: dict[str, set[str]] = {}
    for ck, targets in loads.items():
        for e in targets:
            out.setdefault(e, set()).update(origins.get(ck, ()))
    return {e: sorted(src) for e, src in out.items() if src}


def learner_digests(export: Export, dtype: torch.dtype) -> dict[str, str]:
    """{name: digest} of the learner's tensors cast to `dtype`, from a fresh export (every rank must call it:
    the gathers are collectives). A push digests what it streams instead (`push_weights(digests=)`); this is
    for the engine as loaded, before any push."""
    return to_host({n: tensor_digest(t.to(dtype)) for n, t in export.tensors()})


def verify_push(export: Export, engine, previous: dict | None = None) -> dict:
    """`check_engine` against a fresh export of the learner's tensors (the engine as loaded at start-up, and
    tests); every rank calls it. Returns the digests to pass as `previous` next time."""
    return check_engine(learner_digests(export, engine.weight_dtype), engine, previous)


def _sync_error(engine, what: str, names: list[str]) -> WeightSyncError:
    return WeightSyncError(
        f"after the weight push the {engine.name} engine's {names[:3]}{' ...' if len(names) > 3 else ''} "
        f"({len(names)} tensors) {what}: the push did not reach the engine whole, or the engine mangled it. "
        f"Train this model with rollout.engine=hf if it persists"
    )


def check_engine(learner: dict[str, str], engine, previous: dict | None = None) -> dict:
    """Check by content that the engine holds what the learner pushed: `learner` is {name: digest} of the
    learner's tensors as pushed (cast to the engine's dtype; rlkit.digests). Raises `WeightSyncError` naming the
    tensors; returns the digests to pass as `previous` to the next check.

    An engine in the checkpoint's layout (HF: `engine.expected_digests()` is None) must hold every pushed tensor
    exactly. One that stacks and repacks them (vLLM) is checked in two steps, both by content:
    - what its last push received (`engine.received_digests()`, digested as its `load_weights` took them) is
      what the learner pushed, tensor by tensor (a push that arrived nowhere, or not whole, or other bytes);
    - every engine tensor a push determines holds, at every position its loaders wrote, what they wrote there
      (`engine.expected_digests()`: the pushed tensors' digests placed at the positions vLLM's own loaders put
      them, against `engine.weight_digests()`: the tensors as held, a repacked linear's read back from its
      kernel), so a layer left stale after the push, or two rows swapped, fails whatever the learning rate.
    Before any push (`received_digests()` None: the engine as loaded) nothing is compared unless a push is being
    verified (`previous` given). Engine tensors whose
    processing after loading changes their values (vLLM's CPU expert prepack) or that no loader wrote are left to
    a check by change (`engine.digest_sources()`: every one built from a learner tensor that changed since
    `previous` must have changed) and to the log-prob probe.
    """
    held = engine.weight_digests()
    expected = engine.expected_digests()
    if expected is None:
        wrong = [n for n, d in learner.items() if held.get(n) != d]
        if wrong or not learner:
            raise WeightSyncError(
                f"after the weight push the {engine.name} engine does not hold the learner's {wrong[:3]} "
                f"({len(wrong)} of {len(learner)} tensors differ): the push did not reach the engine whole"
            )
        return {"learner": learner, "engine": held}
    received = engine.received_digests()
    if received is None and previous is not None:  # a push is being verified, and the engine received none
        received = {}
    if received is not None:
        late = [n for n, d in learner.items() if received.get(n) != d]
        if late or not learner:
            raise _sync_error(engine, "were not received as the learner pushed them", late)
        wrong = [e for e, d in expected.items() if held.get(e) != d]
        if wrong:
            raise _sync_error(engine, "do not hold what the push loaded into them", wrong)
    if previous is not None:
        _check_by_change(learner, engine, previous, {e: d for e, d in held.items() if e not in expected})
    return {"learner": learner, "engine": held}


def _check_by_change(learner: dict[str, str], engine, previous: dict, held: dict[str, str]) -> None:
    """The engine tensors `held` that the content check cannot read: unchanged learner weights must leave every
    one as it was; one built from a learner tensor that changed must have changed."""
    sources = engine.digest_sources()
    changed = {n for n, d in learner.items() if previous["learner"].get(n) != d}
    before = previous["engine"]
    if not changed:
        moved = [e for e, d in held.items() if e in before and before[e] != d]
        if moved:
            raise _sync_error(engine, "changed although the learner's weights did not", moved)
    stale = [e for e, src in sources.items() if e in held and changed & set(src) and before.get(e) == held[e]]
    if stale:
        raise _sync_error(
            engine, "did not change although the learner's weights they are built from did", stale
        )


# -- the log-prob probe: the engine's forward against the learner's on fixed tokens --------------------------

PROBE_BOUND = {
    (torch.float32, "cpu"): 1e-4,
    (torch.float32, "cuda"): 0.03,
    (torch.bfloat16, "cpu"): 0.25,
    (torch.bfloat16, "cuda"): 0.25,
    (torch.float16, "cpu"): 0.05,
    (torch.float16, "cuda"): 0.05,
}
"""The mean |engine - learner| log-prob on the probe's tokens above which a push (or the engine as loaded) is
refused, by (dtype, the engine's platform), for the lower precision of the two sides:
- fp32 on the CPU: the families rlkit tests agree to ~5e-7 (tests/rollout/test_families.py,
  docs/supported-models.md), while an engine missing its MoE expert prepack after a push differed by 2e-2.
- fp32 on CUDA (not measured yet: scripts/gpu_check.py's probe gap is the measurement to take): vLLM's Triton
  attention computes its fp32 dot products in TF32 (10 mantissa bits, 3 more than bf16), so the gap is expected
  at about bf16's measured 0.064 / 8, ~8e-3 (issue 61 item 3 estimated 1e-3); 0.03 keeps bf16's margin (~4x)
  over that. A stale or mangled tensor at a small learning rate is caught by the content digests, not the probe.
- bf16 (any platform): on SmolLM2-135M the probe's random tokens (log-probs around -11) read 0.045 between an fp32
  forward and a bf16-autocast one and 0.064 with bf16 weights (max 0.27), so an engine and a learner both off by
  that much stay under 0.25; a drift as small as the MoE one is then left to the digests.
- fp16 (3 more mantissa bits than bf16, not measured): 0.05.
A platform other than the CPU (vLLM's ROCm reports "cuda"; XPU, TPU) takes the CUDA entry: accelerator kernels may
compute with reduced-precision dots; a dtype not listed takes bf16's."""


def probe_bound(*dtypes: torch.dtype, platform: str = "cpu") -> float:
    """The probe's bound for log-probs computed in `dtypes` (the learner's and the engine's) by an engine on
    `platform` (vLLM's device type: "cpu", "cuda", ...): the loosest (PROBE_BOUND)."""
    key = "cpu" if platform == "cpu" else "cuda"
    return max(PROBE_BOUND.get((d, key), PROBE_BOUND[(torch.bfloat16, key)]) for d in dtypes)


def probe_vocab(tokenizer_size: int, embedding_rows: int) -> int:
    """The ids the probe may use: those both the tokenizer (vLLM refuses a prompt id beyond it) and the model's
    embedding (which may have padding rows beyond the tokenizer, or fewer rows) know."""
    return max(1, min(int(tokenizer_size), int(embedding_rows)))


def probe_tokens(vocab_size: int = 1000, *, rows: int = 2, length: int = 32, seed: int = 0) -> Tensor:
    """[rows, length] token ids spread over the whole vocabulary `[0, vocab_size)`: one drawn in each of
    rows x length equal slices of it, in a shuffled order, the same on every call. The probe's fixed input: a
    stale or swapped row of the embedding or the output head is read wherever it sits, near the top of the
    vocabulary too (ids below 1000 only, before: issue 56). The learner sends them with its log-probs (async) or
    hands them to the engine's check itself (`Export.probe_vocab`)."""
    g = torch.Generator().manual_seed(seed)
    n = rows * length
    lo = torch.tensor([i * vocab_size // n for i in range(n)])
    hi = torch.tensor([(i + 1) * vocab_size // n for i in range(n)])
    ids = lo + (torch.rand(n, generator=g) * (hi - lo).clamp(min=1)).long()
    return ids.clamp(max=vocab_size - 1)[torch.randperm(n, generator=g)].view(rows, length)


def probe_input(export: Export) -> tuple[Tensor, tuple | None]:
    """(tokens, images) the probe runs on: the export's `probe_prompt` (a prompt with a picture per row), else the
    fixed tokens over its `probe_vocab` and no images."""
    if export.probe_prompt is not None:
        return export.probe_prompt
    return probe_tokens(export.probe_vocab), None


def learner_probe(export: Export, tokens: Tensor, images: tuple | None) -> Tensor:
    """The learner's probe log-probs of `tokens` (with each row's `images` where the probe has them)."""
    return export.probe(tokens) if images is None else export.probe(tokens, images)


# The text that marks one picture in a prompt, by processor class (else its `image_token`): the processor expands
# it into the picture's placeholder tokens.
_PICTURE_MARKS = {
    "Qwen2VLProcessor": "<|vision_start|><|image_pad|><|vision_end|>",
    "Qwen2_5_VLProcessor": "<|vision_start|><|image_pad|><|vision_end|>",
    "Qwen3VLProcessor": "<|vision_start|><|image_pad|><|vision_end|>",
}


def vl_probe_prompt(processor, vocab_size: int, *, rows: int = 2, length: int = 32, seed: int = 0):
    """`Export.probe_prompt` for a vision-language model: per row a fixed random picture (56x56 RGB, drawn from
    `seed`) marked as the processor's family expects and expanded by it, then `length` ids drawn as
    `probe_tokens` draws them, the tokenizer's added tokens (image placeholders among them) left out."""
    from PIL import Image

    g = torch.Generator().manual_seed(seed)
    mark = _PICTURE_MARKS.get(type(processor).__name__) or processor.image_token
    added = torch.tensor(
        sorted(i for i in processor.tokenizer.added_tokens_decoder if i < vocab_size), dtype=torch.long
    )
    plain = torch.ones(vocab_size, dtype=torch.bool)
    plain[added] = False
    plain = plain.nonzero().flatten()  # the ids no added token (an image placeholder among them) holds
    drawn = probe_tokens(vocab_size, rows=rows, length=length, seed=seed)
    drawn = torch.where(torch.isin(drawn, added), plain[drawn % len(plain)], drawn)
    ids, images = [], []
    for r in range(rows):
        pixels = torch.randint(0, 256, (56, 56, 3), generator=g, dtype=torch.uint8).numpy()
        picture = Image.fromarray(pixels, "RGB")
        out = processor(text=[mark], images=[[picture]], return_tensors="pt")
        tensors = {k: v for k, v in out.items() if k not in ("input_ids", "attention_mask")}
        digest = hashlib.sha256(repr(picture.size).encode() + picture.tobytes()).hexdigest()
        images.append(Images(pictures=(picture,), tensors=tensors, digest=digest))
        ids.append(out["input_ids"][0].tolist() + drawn[r].tolist())
    if len({len(row) for row in ids}) != 1:
        raise ValueError("the probe's pictures expanded to different numbers of placeholders")
    return torch.tensor(ids), tuple(images)


def probe_gap(engine_logp: Tensor, learner_logp: Tensor) -> float:
    """Mean |engine - learner| log-prob over the probe's tokens."""
    return float((engine_logp.float() - learner_logp.float()).abs().mean())


def check_probe(
    gap: float,
    bound: float,
    *,
    when: str,
    engine: str,
    accepted: float | None = None,
    at_load: bool = False,
    on: str = "the probe's fixed tokens",
) -> None:
    """Raise `WeightSyncError` when the probe's `gap` exceeds `bound` (or the gap the run `accepted`,
    `rollout.accept_engine_gap`, when that is larger). `at_load`: the engine as loaded, before any push (a gap
    there is the engine's forward; after a push it is the push). `on`: the tokens the gap was measured on (the
    fixed ones, or a batch the engine sampled: rlkit.sync.WeightSync.check_batch)."""
    limit = bound if accepted is None else max(bound, accepted)
    if gap <= limit:
        return
    if at_load:
        why = (
            "The engine's forward differs from the learner's for this model on this platform: train with "
            f"rollout.engine=hf, or accept the gap with rollout.accept_engine_gap={float(f'{gap * 1.5:.1g}')} (the run "
            "then trains on log-probs that differ by that much)"
        )
    else:
        why = "The push left the engine computing something else (stale or mangled tensors): train with rollout.engine=hf"
    raise WeightSyncError(
        f"the {engine} engine's log-probs differ from the learner's {when}: mean |dlogp| = {gap:.3g} on {on}, "
        f"above {limit:.3g} (the bound of this compute dtype"
        f"{'' if accepted is None else ' or rollout.accept_engine_gap'}). {why}"
    )
