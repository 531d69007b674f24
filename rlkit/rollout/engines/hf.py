"""The Hugging Face rollout engine: batched sampling with a transformers model, on CPU or GPU.

A plain sampling loop over the model's forward with a KV cache, rather than `model.generate`,
because the engine must know exactly which distribution every token was drawn from and where
every sequence ended: with `generate`, a tokenizer whose pad token is its EOS token (SmolLM2)
makes a finished sequence's padding indistinguishable from its EOS, and stop strings do not say
which row they stopped. The loop is the same arithmetic as `generate`: the prompt is prefilled
once per prompt (its KV cache is then repeated for the `n` samples; once per sample for a model whose layers
carry a recurrent or convolution state, which transformers' cache cannot repeat), then one forward per token.
"""

from __future__ import annotations

import copy
import dataclasses
import logging
import time
from collections.abc import Collection, Iterable

import torch
from torch import Tensor
from transformers import LogitsProcessorList, TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

from rlkit.batch import Images, RolloutBatch
from rlkit.digests import tensor_digest, to_host
from rlkit.models import load_causal_lm, load_tokenizer, stateful_layers
from rlkit.rollout.engines.base import Sampling, check_generate_args, record_throughput, rows_to_batch
from rlkit.vision import has_3d_positions, image_kwargs, rope_deltas
from rlkit.weights import PushGuard, check_manifest, module_manifest

log = logging.getLogger(__name__)


class HFEngine:
    """Rollout engine on a transformers causal LM.

    `model_or_path` is a model path (see `rlkit.models.resolve_model`) or an already loaded model;
    a loaded model is deep-copied, so the engine always holds its own weights, which change only
    through `load_weights` (the learner's model may be wrapped, sharded or mid-update).

    Log-probs: `rollout_logprobs[i, t]` is the log-probability of the sampled token under the
    distribution it was actually drawn from: logits / temperature, then top-k, then top-p
    (transformers' warpers, in generate's order), renormalised over the tokens that survive the
    truncation. With `top_k=0, top_p=1` it is exactly `log_softmax(logits / temperature)`, which is
    what the learner recomputes. Greedy (`temperature=0`) picks the argmax and reports
    `log_softmax(logits)` (temperature 1), as vLLM does, so the value stays informative.

    `sleep`/`wake` move the model to the CPU and back when it lives on a GPU (freeing the GPU
    for the learner); on CPU they do nothing.
    """

    name = "hf"

    def __init__(
        self,
        model_or_path,
        tokenizer=None,
        *,
        dtype: torch.dtype = torch.float32,
        device: str | torch.device = "cpu",
        seed: int = 0,
        max_batch_size: int = 256,
        vision: bool = False,
    ):
        """`max_batch_size`: the most sequences (prompts x n) sampled in one forward batch. `vision`: load a
        vision-language checkpoint whole, for prompts with images (`rlkit.models.load_causal_lm`)."""
        if isinstance(model_or_path, torch.nn.Module):
            model = copy.deepcopy(model_or_path).to(device=device, dtype=dtype)
            if tokenizer is None:
                raise ValueError("HFEngine(model, tokenizer=None): pass the tokenizer with a loaded model")
        else:
            model = load_causal_lm(model_or_path, dtype=dtype, device=device, vision=vision)
            tokenizer = tokenizer if tokenizer is not None else load_tokenizer(model_or_path)
        if max_batch_size < 1:
            raise ValueError(f"max_batch_size={max_batch_size} must be >= 1")
        self.model = model.eval().requires_grad_(False)
        self.tokenizer = tokenizer
        self.device = torch.device(device)
        self.platform = self.device.type
        self.max_batch_size = max_batch_size
        self.generator = torch.Generator(self.device).manual_seed(seed)
        if tokenizer.pad_token_id is None:
            log.warning("tokenizer has no pad token: padding with EOS id %s", tokenizer.eos_token_id)
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        self.eos_ids = sorted(_eos_ids(model, tokenizer))
        if not self.eos_ids:
            raise ValueError("neither the model's generation config nor the tokenizer defines an EOS token")
        self.text_config = model.config.get_text_config(decoder=True)
        self.context = getattr(self.text_config, "max_position_embeddings", None)
        # Layers with a state across positions (hybrid families): the prompt is prefilled once per sample.
        self.stateful = bool(stateful_layers(model.config))
        self._sleeping = False

        self.manifest = module_manifest(self.model)  # what a weight push must bring
        self._push_guard = PushGuard(self.name)
        self.version = 0  # the policy version held (set by the owner after each push)

    def set_version(self, version: int) -> None:
        """The weights held now are policy version `version`: every token of a later batch carries it."""
        self.version = int(version)

    # ---------------------------------------------------------------- generation

    @torch.inference_mode()
    def generate(
        self, prompts: list[list[int]], n: int, sampling: Sampling, images: list[Images | None] | None = None
    ) -> RolloutBatch:
        """Sample `n` completions for each prompt; the `n` rows of prompt i are rows `i*n ... i*n+n-1`.

        prompts: B lists of token ids (no padding). Returns a RolloutBatch with N = B * n rows.
        A row stops at an EOS token or at the end of an extra stop string (both kept in the
        response, finish reason "stop"; never with `sampling.ignore_eos`), or after `max_new_tokens`
        tokens or at the model's context end (finish reason "length"). Reproducible: the same seed
        gives the same samples. `images` (aligned with `prompts`, rlkit.batch.Images or None each) go to a
        vision-language model's forward with their prompt; the batch's rows carry them.
        """
        check_generate_args(prompts, n, self.context, self.text_config.vocab_size)
        if images is not None and len(images) != len(prompts):
            raise ValueError(f"generate: {len(images)} images for {len(prompts)} prompts")
        if images is not None and all(x is None for x in images):
            images = None
        if images is not None and getattr(self.model.config, "vision_config", None) is None:
            raise ValueError("generate: images given to a text-only model (its config has no vision_config)")
        if self._sleeping:  # as vLLM does: an engine asked to generate wakes itself
            self.wake()
        self._push_guard.check()
        generator = self.generator
        if sampling.seed is not None:
            generator = torch.Generator(self.device).manual_seed(sampling.seed)

        t0 = time.perf_counter()
        prompts_per_chunk = max(1, self.max_batch_size // n)
        rows: list[tuple[list[int], list[float], str]] = []
        for start in range(0, len(prompts), prompts_per_chunk):
            chunk = slice(start, start + prompts_per_chunk)
            rows += self._sample(
                prompts[chunk], n, sampling, generator, None if images is None else images[chunk]
            )
        seconds = time.perf_counter() - t0

        group_prompts = [p for p in prompts for _ in range(n)]
        texts = self.tokenizer.batch_decode([r[0] for r in rows], skip_special_tokens=True)
        # One version per batch: weights change only between generate calls here.
        versions = [[self.version] * len(r[0]) for r in rows]
        batch = rows_to_batch(group_prompts, rows, texts, n, self.pad_id, versions)
        if images is not None:
            batch = dataclasses.replace(batch, images=tuple(x for x in images for _ in range(n)))
        return record_throughput(batch, seconds)

    def _sample(
        self, prompts, n, sampling, generator, images=None
    ) -> list[tuple[list[int], list[float], str]]:
        """One forward batch: prefill B prompts, repeat the cache n times, decode token by token.

        With images, the prefill takes their tensors (`rlkit.vision.image_kwargs`) and a model with 3D rotary
        positions (Qwen's VL models) computes the prompt's positions itself, from the attention mask; each
        decoded token then sits at the row's length + the model's offset for it (`rope_deltas`), on all three
        axes, as the model's own generate places it."""
        dev = self.device
        plens = torch.tensor([len(p) for p in prompts], device=dev)
        width = int(plens.max())
        ids = torch.full((len(prompts), width), self.pad_id, dtype=torch.long, device=dev)
        mask = torch.zeros_like(ids)
        for i, p in enumerate(prompts):
            ids[i, width - len(p) :] = torch.tensor(p, device=dev)
            mask[i, width - len(p) :] = 1
        # Left padding: real tokens get positions 0..len-1, exactly as in the learner's forward.
        positions = (mask.cumsum(-1) - 1).clamp(min=0)
        if self.stateful:  # transformers cannot repeat a recurrent/convolution state: each sample prefills
            ids, mask, positions, plens = (x.repeat_interleave(n, 0) for x in (ids, mask, positions, plens))
            images = None if images is None else [x for x in images for _ in range(n)]
        vision = image_kwargs(self.model, images, ids)
        delta = None
        if vision and has_3d_positions(self.model):
            positions = None  # the model computes its 3D positions from the mask and the grid sizes
        out = self.model(
            input_ids=ids,
            attention_mask=mask,
            position_ids=positions,
            use_cache=True,
            logits_to_keep=1,
            **vision,
        )
        if vision and positions is None:
            delta = rope_deltas(self.model).reshape(-1).to(dev)
        cache, logits = out.past_key_values, out.logits[:, -1]
        if not self.stateful:
            cache.batch_repeat_interleave(n)
            logits, mask, plens = (x.repeat_interleave(n, 0) for x in (logits, mask, plens))
            delta = None if delta is None else delta.repeat_interleave(n, 0)

        num = logits.shape[0]
        # A row also ends at the model's context (finish reason "length"), as vLLM does.
        limit = torch.full_like(plens, sampling.max_new_tokens)
        if self.context is not None:
            limit = torch.clamp(self.context - plens, max=sampling.max_new_tokens)
        steps = int(limit.max())
        warpers = _warpers(sampling)
        eos = torch.tensor(self.eos_ids, device=dev)
        tokens = torch.full((num, steps), self.pad_id, dtype=torch.long, device=dev)
        logps = torch.zeros((num, steps), dtype=torch.float32, device=dev)
        done = torch.zeros(num, dtype=torch.bool, device=dev)
        stopped = torch.zeros(num, dtype=torch.bool, device=dev)
        lengths = torch.zeros(num, dtype=torch.long, device=dev)
        for t in range(steps):
            token, logp = _draw(logits.float(), sampling.temperature, warpers, generator)
            live = ~done
            tokens[:, t] = torch.where(live, token, self.pad_id)
            logps[:, t] = torch.where(live, logp, 0.0)
            lengths += live.long()
            if not sampling.ignore_eos:
                hit_stop = live & torch.isin(token, eos)
                if sampling.stop:
                    hit_stop |= live & self._stop_string_hit(tokens, lengths, live, sampling.stop)
                stopped |= hit_stop
                done |= hit_stop
            done |= lengths >= limit
            if bool(done.all()):
                break
            mask = torch.cat([mask, torch.ones_like(mask[:, :1])], dim=1)
            step = (plens + t)[:, None]
            if delta is not None:  # 3D positions: the same text position on the three axes
                step = (step + delta[:, None]).expand(3, -1, -1)
            out = self.model(
                input_ids=token[:, None],
                attention_mask=mask,
                position_ids=step,
                past_key_values=cache,
                use_cache=True,
            )
            cache = out.past_key_values
            logits = out.logits[:, -1]

        tokens, logps, lengths, stopped = tokens.cpu(), logps.cpu(), lengths.tolist(), stopped.tolist()
        return [
            (
                tokens[i, : lengths[i]].tolist(),
                logps[i, : lengths[i]].tolist(),
                "stop" if stopped[i] else "length",
            )
            for i in range(num)
        ]

    def _stop_string_hit(
        self, tokens: Tensor, lengths: Tensor, live: Tensor, stop: tuple[str, ...]
    ) -> Tensor:
        """[N] bool: the newest token completes one of the stop strings.

        Only the last few tokens are decoded: a stop string of L characters spans at most L
        tokens, and since this runs after every token, a stop string inside that window can only
        have been completed by the newest token.
        """
        window = max(len(s) for s in stop) + 1
        hit = torch.zeros_like(live)
        for i in torch.nonzero(live).flatten().tolist():
            end = int(lengths[i])
            text = self.tokenizer.decode(tokens[i, max(0, end - window) : end].tolist())
            hit[i] = any(s in text for s in stop)
        return hit

    # ---------------------------------------------------------------- weights and memory

    @torch.no_grad()
    def load_weights(self, named_tensors: Iterable[tuple[str, Tensor]], *, manifest=None) -> int:
        """Copy `(hf_name, full_tensor)` pairs into the engine's model in place; returns how many.

        The contract both engines keep (rlkit/weights.py): `manifest` ({name: shape}, from the
        learner's parameter metadata) is checked against the engine's own before the first copy
        (`WeightManifestError`); without one the engine's own manifest is used, so the push must be
        complete. Tied weights come once, under their first name. An unknown name raises `KeyError`,
        a wrong shape `WeightManifestError` (a `ValueError`), an empty push `RuntimeError`; a push
        that fails after copying began leaves the engine refusing to generate until a complete push.
        """

        if manifest is not None:
            check_manifest(manifest, self.manifest, engine=self.name)
        params = self.model.state_dict(keep_vars=True)

        def copy(stream):
            for name, tensor in stream:
                params[name].copy_(tensor)

        return self._push_guard.run(copy, named_tensors, self.manifest)

    @property
    def weight_dtype(self) -> torch.dtype:
        return next(self.model.parameters()).dtype

    def weight_digests(self, names: Collection[str] | None = None) -> dict[str, str]:
        """The digest (rlkit.digests, on the engine's device) of each tensor of the push manifest (of `names` only,
        unless None) as this engine holds it (rlkit.verify.check_engine)."""
        params = self.model.state_dict()
        return to_host({n: tensor_digest(params[n]) for n in self.manifest if names is None or n in names})

    def expected_digests(self) -> None:
        """None: this engine holds the checkpoint's layout, so it must hold exactly what the learner pushed."""
        return None

    def digest_sources(self) -> None:
        """None: this engine holds the checkpoint's layout, so a push is checked tensor for tensor."""
        return None

    def sleep(self, *, keep_weights: bool = False) -> None:
        """Move the model off the GPU while the learner trains (nothing to free on CPU); the weights always
        survive (`keep_weights` changes nothing here)."""
        if self.device.type != "cpu" and not self._sleeping:
            self.model.to("cpu")
            torch.cuda.empty_cache()
        self._sleeping = self.device.type != "cpu"

    def wake(self) -> None:
        if self._sleeping:
            self.model.to(self.device)
        self._sleeping = False

    def close(self) -> None:
        self.model = None
        if self.device.type == "cuda":
            torch.cuda.empty_cache()


def _eos_ids(model, tokenizer) -> set[int]:
    ids = set()
    gen_eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    for value in (gen_eos, tokenizer.eos_token_id):
        if isinstance(value, int):
            ids.add(value)
        elif value is not None:
            ids.update(value)
    return ids


def _warpers(sampling: Sampling) -> LogitsProcessorList:
    """temperature -> top-k -> top-p, generate's order; empty for greedy."""
    warpers = LogitsProcessorList()
    if sampling.temperature == 0:
        return warpers
    if sampling.temperature != 1.0:
        warpers.append(TemperatureLogitsWarper(sampling.temperature))
    if sampling.top_k > 0:
        warpers.append(TopKLogitsWarper(sampling.top_k))
    if sampling.top_p < 1.0:
        warpers.append(TopPLogitsWarper(sampling.top_p))
    return warpers


def _draw(logits: Tensor, temperature: float, warpers, generator) -> tuple[Tensor, Tensor]:
    """logits [N, V] float32 -> (token [N], log-prob of token under the sampling distribution [N])."""
    if temperature == 0:
        token = logits.argmax(-1)
        return token, torch.log_softmax(logits, -1).gather(-1, token[:, None]).squeeze(-1)
    # Warpers ignore input_ids for temperature/top-k/top-p.
    logp = torch.log_softmax(warpers(None, logits), -1)
    token = sample_rows(logp.exp(), generator)
    return token, logp.gather(-1, token[:, None]).squeeze(-1)


def sample_rows(probs: Tensor, generator) -> Tensor:
    """One index per row of `probs` [N, V] (non-negative, each row summing to about 1), by inverse transform:
    the row's cumulative sum in float64 against one uniform draw. `torch.multinomial` draws V random numbers
    a row on CPU (about 20x slower at SmolLM2's 49,152-token vocabulary, where it cost more than the tiny
    model's forward); this draws one. An entry of probability zero (cut by top-k or top-p) is never drawn:
    the index is the first whose cumulative sum exceeds the draw, which lies below the row's total."""
    cdf = probs.double().cumsum(-1)
    total = cdf[:, -1:]
    u = torch.rand(total.shape, generator=generator, device=probs.device, dtype=torch.float64)
    point = torch.minimum(u * total, torch.nextafter(total, torch.zeros_like(total)))
    return torch.searchsorted(cdf, point, right=True).squeeze(-1)
