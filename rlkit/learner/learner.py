"""The learner: the policy (and reference, teacher, critic), its forward passes, the update, the export.

It takes per-token tensors and knows no groups or rewards (those are rlkit/learn.py's). Batching, the loss,
the optimizer, LoRA and checkpoint I/O are this package's other modules; this one holds the models and
calls them.

One `update(batch)` call, top to bottom:

1. check that the batch carries every field the configured loss needs (before any collective, so a
   misconfigured run fails with a message on every rank instead of hanging inside an all-reduce);
2. recompute old log-probs if the update is off-policy (more than one optimizer step per batch);
3. split the local rows into `algo.mini_batches` mini-batches of token-budget micro-batches and reduce
   the micro-batch counts (MAX) and the loss denominators (SUM) once (batching.py);
4. for each epoch and mini-batch: run every micro-batch (padding ones included, so each rank runs the
   same number), assemble its loss with the GLOBAL denominators (loss.py), backward, then clip, step
   and schedule (optim.py); a step whose loss or gradient norm is not finite is skipped on the device
   and counted (`train/nonfinite_steps`), and the count reaches the host with the metrics.

Why global denominators: `token-mean` over a mini-batch split into micro-batches on several ranks is
sum(loss * mask) / (tokens in the whole mini-batch on all ranks). Each micro-batch divides its own sum by
that global count, and the data-parallel wrapper's gradient averaging over ranks is undone by multiplying
by the world size, so the accumulated gradient equals the gradient of the full-batch loss.

Models: the policy is any causal LM transformers loads (through `rlkit.models`); the frozen reference
(only when `algo.kl_coef > 0`) is a second copy of the initial policy in the compute dtype, sharded like
the policy under FSDP2 (a full copy per rank otherwise; with LoRA the policy with adapters off); the
distillation teacher (only when `algo.distill_coef > 0`, rlkit/learner/teacher.py) is prepared the same way
from `algo.teacher.path`; the PPO critic (`algo.value_model`) is `AutoModelForTokenClassification` with one
label on the same checkpoint.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import time
from collections.abc import Iterator
from pathlib import Path

import torch
import torch.distributed as dist
from torch import Tensor

from rlkit.batch import Sequences, TrainBatch
from rlkit.checkpoints import CheckpointError, latest_checkpoint
from rlkit.collectives import all_reduce
from rlkit.config.derived import derive
from rlkit.config.schema import ConfigError
from rlkit.envs import takes_images
from rlkit.flops import ModelShape, sequence_flops
from rlkit.learner import checkpoint, compiled, optim, routing, teacher
from rlkit.learner.batching import (
    Micro,
    MiniBatch,
    check_sharded_images,
    microbatches,
    model_inputs,
    packing,
    padding_micro,
    plan_minibatches,
)
from rlkit.learner.logprobs import LogProbs, critic_values, score
from rlkit.learner.lora import add_adapters, base_manifest, merged_weights
from rlkit.learner.loss import MicroInputs, micro_loss
from rlkit.learner.reuse import ForwardScores
from rlkit.learner.strategy import make_accelerator
from rlkit.metrics import MetricMerger
from rlkit.models import eval_mode, load_causal_lm, load_tokenizer, load_value_model, train_without_dropout
from rlkit.verify import probe_vocab
from rlkit.vision import freeze_language_model, freeze_vision_tower
from rlkit.weights import Export, iter_full_parameters, module_manifest, reshard

NONFINITE_METRIC = "train/nonfinite_steps"  # optimizer steps of a training step skipped as non-finite


def check_frozen_parts(cfg) -> None:
    """`model.freeze_language` (raises ConfigError): it freezes the language model of a run with images, so it
    needs data.image_key, and LoRA (whose adapters sit in the language model only) would leave nothing to train."""
    m = cfg.model
    if not m.freeze_language:
        return
    if cfg.data.image_key is None:
        raise ConfigError(
            "model.freeze_language=true freezes the language model of a vision-language run with images, but "
            "data.image_key is null (a text run would have nothing left to train): set data.image_key, or "
            "model.freeze_language=false (valid: true | false)"
        )
    if m.lora.rank > 0:
        raise ConfigError(
            f"model.freeze_language=true with model.lora.rank={m.lora.rank}: LoRA adapts the language model's "
            "layers only, which freeze_language freezes, so nothing would train; use model.lora.rank=0, or "
            "model.freeze_language=false (valid: true | false)"
        )


class Learner:
    """Owns the policy (and optional reference / critic), the optimizer and the LR schedule.

    `cfg` is the run's `RLConfig`; what the learner derives from it is computed once, here.
    """

    def __init__(self, cfg, accelerator=None):
        from accelerate.utils import set_seed

        a, t, m = cfg.algo, cfg.trainer, cfg.model
        self.cfg, self.algo = cfg, a
        self.derived = d = derive(cfg)  # optimizer steps, off-policy or not, KL loss coefficient, ...
        self.max_grad_norm = t.max_grad_norm if t.max_grad_norm is not None else float("inf")
        self.accelerator = accelerator if accelerator is not None else make_accelerator(cfg)
        set_seed(t.seed)
        acc = self.accelerator
        self.device = acc.device
        self.world_size = acc.num_processes
        self.compute_dtype = torch.bfloat16 if acc.mixed_precision == "bf16" else torch.float32

        self.lora = m.lora.rank > 0
        # fp32 master weights; accelerate casts compute to bf16 under mixed precision. With LoRA only
        # the adapters train: the frozen base is loaded in the compute dtype (no fp32 master copy).
        # The VL model whole, its forward taking the images (the data's, an environment's).
        self.vision = takes_images(cfg)
        policy = load_causal_lm(
            m.path, dtype=self.compute_dtype if self.lora else torch.float32, device="cpu", vision=self.vision
        )
        policy.config.use_cache = False
        if self.vision and m.freeze_vision:
            freeze_vision_tower(policy)
        if self.vision and m.freeze_language:  # the vision side's warm-up (recipes/sft_see.yaml)
            freeze_language_model(policy)
        self.packed = packing(t.pack_sequences, policy)
        # Mixture-of-experts: no router auxiliary (load-balancing) loss. rlkit's loss is built from the
        # log-probs alone and transformers adds that term only to its own `loss` (with labels, which rlkit never
        # passes); router logits are not even returned, so none are computed for nothing (docs: Supported models).
        if getattr(policy.config, "output_router_logits", False):
            policy.config.output_router_logits = False
        train_without_dropout(policy)  # from_pretrained leaves it in eval mode, where nothing is checkpointed
        if m.gradient_checkpointing:
            policy.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        if a.routing_replay:  # the routers replay the engine's routes of each batch (rlkit.learner.routing)
            routing.install(policy)
        if self.lora:
            policy = add_adapters(policy, m.lora, gradient_checkpointing=m.gradient_checkpointing)
        self.ref_model = None
        if a.kl_coef > 0 and not self.lora:  # LoRA: the base, adapters off
            self.ref_model = self._prepare_frozen(
                load_causal_lm(m.path, dtype=self.compute_dtype, device="cpu", vision=self.vision)
            )
        self.teacher = None  # on-policy distillation's teacher: frozen, never the policy with adapters off
        if teacher.enabled(cfg):
            self.teacher = self._prepare_frozen(teacher.load(cfg, self.compute_dtype))

        self.model, self.optimizer = acc.prepare(policy, optim.adamw(policy, t))
        if t.compile:
            compiled.compile_policy(acc.unwrap_model(self.model), t.compile_backend)
        self.scheduler = optim.scheduler(self.optimizer, t, d.optimizer_steps)
        self.value_model = self.value_optimizer = self.value_scheduler = None
        if a.value_model:
            critic = train_without_dropout(load_value_model(m.path))
            if m.gradient_checkpointing:
                critic.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
            self.value_model, self.value_optimizer = acc.prepare(critic, optim.adamw(critic, t))
            self.value_scheduler = optim.scheduler(self.value_optimizer, t, d.optimizer_steps)
        self.global_step = 0
        self.nonfinite_run = 0  # optimizer steps skipped in a row (non-finite loss or gradient norm)
        self.manifest = self._manifest()
        self.shape = ModelShape.of(acc.unwrap_model(self.model))  # for the FLOP count

    def _prepare_frozen(self, model: torch.nn.Module) -> torch.nn.Module:
        """The frozen reference: under FSDP2 sharded like the policy (each rank holds 1/world of it and
        all-gathers one block at a time in forward), else a full copy on this rank's device."""
        model.requires_grad_(False)  # before sharding: accelerate upcasts only trainable params to fp32
        model.eval()
        if self.accelerator.is_fsdp2:
            from accelerate.utils.fsdp_utils import fsdp2_prepare_model

            return fsdp2_prepare_model(self.accelerator, model)
        return model.to(self.device)

    # -- forward passes ------------------------------------------------------------------------

    def _scores(self, model, m: Micro, *, entropy: bool, entropy_grad: bool = False):
        r, t = self.cfg.rollout, self.cfg.trainer
        inp = model_inputs(m, packed=self.packed, device=self.device)
        return score(
            model, self.accelerator.unwrap_model(model), inp, temperature=r.temperature, top_k=r.top_k,
            top_p=r.top_p, chunk_tokens=t.logprob_chunk_tokens, entropy=entropy, entropy_grad=entropy_grad,
            compute_dtype=self.compute_dtype,
        )  # fmt: skip

    def _values(self, m: Micro) -> Tensor:
        inp = model_inputs(m, packed=self.packed, device=self.device)
        return critic_values(self.value_model, inp)

    @torch.no_grad()
    def forward(
        self, batch, *, policy: bool = True, ref: bool = False, values: bool = False, teacher: bool = False,
        skip_empty: bool = False,
    ) -> LogProbs:  # fmt: skip
        """Score a RolloutBatch, TrainBatch or Sequences (prompt_ids/prompt_mask/response_ids/response_mask).

        Returns detached [N, T] float32 tensors, 0 where `response_mask` is False. Every rank must call
        it (FSDP all-gathers inside); `ref=True` needs `algo.kl_coef > 0`, `values=True` needs a critic,
        `teacher=True` needs `algo.distill_coef > 0`. `skip_empty`: rows without a True token are not run.
        """
        if teacher and self.teacher is None:
            raise ValueError(
                "forward(teacher=True) needs a teacher; it is loaded only when algo.distill_coef > 0"
            )
        if ref and self.ref_model is None and not self.lora:
            raise ValueError(
                "forward(ref=True) needs a reference model; it is loaded only when algo.kl_coef > 0"
            )
        if values and self.value_model is None:
            raise ValueError("forward(values=True) needs a critic; set algo.value_model=true")
        check_sharded_images(batch.images, sharded=self.vision and self.accelerator.is_fsdp2)
        rows = Sequences.of(batch)
        n, t_full = rows.response_ids.shape
        wanted = {
            "logprobs": policy, "entropy": policy, "ref_logprobs": ref, "values": values, "teacher_logprobs": teacher,
        }  # fmt: skip
        out = {k: torch.zeros(n, t_full, device=self.device) for k, on in wanted.items() if on}
        t = self.cfg.trainer
        micros = microbatches(rows, t.max_tokens_per_microbatch, packed=self.packed, skip_empty=skip_empty)
        count = all_reduce(
            torch.tensor([len(micros)], device=self.device),
            self.world_size,
            self.device,
            op=dist.ReduceOp.MAX,
        )
        micros = micros + [padding_micro(rows)] * (int(count[0]) - len(micros))  # every rank runs as many
        with eval_mode(self.model, self.value_model):  # scores without dropout (LoRA's): deterministic
            for m in micros:
                self._forward_micro(m, out, policy=policy, ref=ref, values=values, teacher=teacher)
        return LogProbs(**out)

    def _forward_micro(self, m: Micro, out: dict, *, policy: bool, ref: bool, values: bool, teacher: bool):
        results = {}
        if policy:
            results["logprobs"], results["entropy"] = self._scores(self.model, m, entropy=True)
        if ref and self.lora:
            with self.accelerator.unwrap_model(self.model).disable_adapter():
                results["ref_logprobs"], _ = self._scores(self.model, m, entropy=False)
        elif ref:
            results["ref_logprobs"], _ = self._scores(self.ref_model, m, entropy=False)
        if teacher:
            results["teacher_logprobs"], _ = self._scores(self.teacher, m, entropy=False)
        if values:
            results["values"] = self._values(m)
        if not m.padding:
            keep = m.batch.response_mask[:, : m.response_len].to(self.device, torch.bool)
            for k, v in results.items():
                out[k][m.rows.to(self.device), : m.response_len] = torch.where(keep, v.float(), 0.0)

    # -- update --------------------------------------------------------------------------------

    def check_batch(self, batch: TrainBatch) -> None:
        """Raise if the configured loss needs a field the batch lacks (called before any collective)."""
        a = self.algo
        check_sharded_images(batch.images, sharded=self.vision and self.accelerator.is_fsdp2)
        needs = [
            ("ref_logprobs", self.derived.kl_loss_coef > 0, f"algo.kl_coef={a.kl_coef} > 0"),
            ("rollout_logprobs", a.rollout_kl_coef > 0, f"algo.rollout_kl_coef={a.rollout_kl_coef} > 0"),
            ("values", a.value_model, "algo.value_model=true (value clipping)"),
            ("returns", a.value_model, "algo.value_model=true (value targets)"),
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

    def plan(self, batch: TrainBatch, mini_batches: int) -> list[MiniBatch]:
        """This rank's rows as `mini_batches` mini-batches of micro-batches (collectives: every rank calls it)."""
        t = self.cfg.trainer
        return plan_minibatches(
            batch, mini_batches, max_tokens=t.max_tokens_per_microbatch, packed=self.packed,
            agg_mode=self.algo.loss_agg_mode, norm_len=self.derived.norm_len, world=self.world_size, device=self.device,
        )  # fmt: skip

    def update(self, batch: TrainBatch, *, scores: ForwardScores | None = None) -> dict[str, Tensor]:
        """`algo.ppo_epochs` passes of `algo.mini_batches` optimizer steps over this rank's rows.

        Returns metrics merged over micro-batches, mini-batches and ranks (token-weighted means; max/min
        keys as max/min), 0-dim float32 CPU tensors, moved to the host together at the end. With `scores`
        (on-policy updates only, rlkit/learner/reuse.py) the update's first forward fills it with the
        pre-update log-probs and entropy, and supplies the rollout IS weights micro-batch by micro-batch.
        """
        self.check_batch(batch)
        self._score_untrained(batch, scores)
        start = time.perf_counter()
        if self.derived.off_policy and batch.old_logprobs is None:
            # The behaviour policy is the one before the first step; later steps are off-policy against it.
            old = self.forward(batch).logprobs.to(batch.response_ids.device)
            batch = dataclasses.replace(batch, old_logprobs=old)
        plans = self.plan(batch, self.algo.mini_batches)

        merger = MetricMerger()
        step_metrics: list[dict[str, Tensor]] = []
        counts = [0.0, 0.0, 0.0]  # real tokens, tokens the model ran on, model FLOPs (host numbers: no sync)
        for _ in range(self.algo.ppo_epochs):
            for mb in plans:
                finite, done = self._accumulate(mb, merger, scores)
                counts = [a + b for a, b in zip(counts, done)]
                step_metrics.append(self._optimizer_step(finite))

        result = merger.compute()
        # With no loss token anywhere (every group zero-std), per-token statistics such as the
        # entropy are undefined, not 0: report NaN so a plot shows a gap instead of a fake collapse.
        # The loss parts really are 0.
        tokens = sum(mb.num_tokens for mb in plans)
        for k, v in result.items():
            if not k.startswith("loss/"):
                result[k] = torch.where(tokens > 0, v, torch.full_like(v, float("nan")))
        skipped = torch.stack([s.pop("skipped") for s in step_metrics])
        for k in step_metrics[0]:
            result[k] = torch.stack([s[k] for s in step_metrics]).mean()
        result[NONFINITE_METRIC] = skipped.sum()
        counted = torch.tensor(counts, dtype=torch.float64, device=self.device)
        real, run, flops = all_reduce(counted, self.world_size, self.device).tolist()
        result = {k: v.detach().float().cpu() for k, v in result.items()}
        self._count_skipped(skipped.cpu().tolist())  # already on the host with the metrics: no extra sync
        seconds = time.perf_counter() - start
        # Counted, not assumed: the rows that went through forward and backward (zero-std rows are skipped).
        result["learner/tokens"] = torch.tensor(real)
        result["learner/run_tokens"] = torch.tensor(run)
        result["learner/flops"] = torch.tensor(flops)
        result["learner/seconds"] = torch.tensor(seconds)
        result["learner/tokens_per_s"] = torch.tensor(real / seconds)
        if self.cfg.trainer.compile:
            result["learner/compiled_graphs"] = torch.tensor(float(compiled.compiled_graphs()))
        return result

    def _count_skipped(self, skipped: list[bool]) -> None:
        """Host-side bookkeeping of the update's skipped steps: the schedule counts applied steps only, and
        `nonfinite_run` the skipped optimizer steps in a row (the trainer stops the run past a limit)."""
        n = int(sum(skipped))
        for opt_scheduler in (self.scheduler, self.value_scheduler):
            if opt_scheduler is not None:
                optim.unschedule(opt_scheduler, n)
        self.global_step -= n
        for s in skipped:
            self.nonfinite_run = self.nonfinite_run + 1 if s else 0

    def accumulate_gradients(
        self, batch: TrainBatch, *, scores: ForwardScores | None = None
    ) -> dict[str, Tensor]:
        """Accumulate into `.grad` the gradient of the loss over the whole global batch, no optimizer step.

        The same path as one mini-batch of `update` (gradient inspection; `scores` as there); returns the
        merged metrics. Call `zero_grad()` between calls.
        """
        self.check_batch(batch)
        self._score_untrained(batch, scores)
        merger = MetricMerger()
        for mb in self.plan(batch, 1):
            self._accumulate(mb, merger, scores)
        return merger.compute()

    def _score_untrained(self, batch: TrainBatch, scores: ForwardScores | None) -> None:
        """Before any optimizer step: score (no grad) the rows `scores` wants that hold no loss token, which
        the update never runs. Every rank calls the forward, with or without such rows."""
        if scores is None:
            return
        if self.derived.off_policy:
            raise ValueError(
                "update(scores=...) needs an on-policy update (algo.ppo_epochs * mini_batches == 1)"
            )
        rows = scores.untrained_rows(batch.response_mask)
        seqs = Sequences(
            batch.prompt_ids, batch.prompt_mask, batch.response_ids, scores.mask & rows[:, None],
            images=batch.images, routed_experts=batch.routed_experts,
        )  # fmt: skip
        lp = self.forward(seqs, skip_empty=True)
        scores.put(rows, lp.logprobs, lp.entropy)

    def zero_grad(self) -> None:
        self.optimizer.zero_grad(set_to_none=True)
        if self.value_optimizer is not None:
            self.value_optimizer.zero_grad(set_to_none=True)

    def _accumulate(
        self, mb: MiniBatch, merger: MetricMerger, scores: ForwardScores | None = None
    ) -> tuple[Tensor, tuple[float, float, float]]:
        """Forward + backward over the micro-batches of one mini-batch (all-reduce on the last one only).
        Returns whether every micro-batch's loss was finite (a 0-dim bool tensor: no host sync) and this
        rank's (real tokens, tokens run, model FLOPs of the real tokens), host numbers."""
        finite = torch.ones((), dtype=torch.bool, device=self.device)
        real = run = flops = 0.0
        packed = self.packed
        for i, m in enumerate(mb.micros):
            with self._no_sync(last=i == len(mb.micros) - 1):
                loss, metrics, weight = self._micro_loss(m, mb, scores)
                finite = finite & torch.isfinite(loss.detach())
                # DDP / FSDP average gradients over ranks; the loss is already this rank's share of the sum.
                self.accelerator.backward(loss * self.world_size)
            merger.add(metrics, weight)
            r, n = m.token_counts(packed=packed)
            real, run = real + r, run + n
            if not m.padding:
                flops += sum(sequence_flops(self.shape, p + t, training=True) for p, t in m.lens)
        return finite, (real, run, flops)

    def _no_sync(self, last: bool):
        """Skip the gradient all-reduce on all but the last micro-batch of a mini-batch."""
        stack = contextlib.ExitStack()
        if not last:
            for model in (self.model, self.value_model):
                if model is not None:
                    stack.enter_context(self.accelerator.no_sync(model))
        return stack

    def _micro_loss(
        self, m: Micro, mb: MiniBatch, scores: ForwardScores | None = None
    ) -> tuple[Tensor, dict, Tensor]:
        t = m.response_len
        logp, entropy = self._scores(self.model, m, entropy=True, entropy_grad=self.algo.entropy_coef > 0)
        is_weights = scores.take(m.rows, logp, entropy) if scores is not None else None

        def field(name: str) -> Tensor | None:
            v = getattr(m.batch, name)
            return None if v is None else v[:, :t].to(self.device)

        inputs = MicroInputs(
            logprobs=logp, entropy=entropy, mask=field("response_mask").bool(), advantages=field("advantages"),
            old_logprobs=field("old_logprobs"), ref_logprobs=field("ref_logprobs"),
            rollout_logprobs=field("rollout_logprobs"),
            is_weights=is_weights if is_weights is not None else field("is_weights"),
            values=self._values(m) if self.value_model is not None else None, old_values=field("values"),
            returns=field("returns"),
        )  # fmt: skip
        return micro_loss(self.algo, self.derived.kl_loss_coef, inputs, mb)

    def _optimizer_step(self, finite_loss: Tensor) -> dict[str, Tensor]:
        """Clip, step, schedule and zero the grads of the policy (and critic); returns grad norms, lr and
        `skipped`. A non-finite loss (on any rank) or gradient norm skips the step of both models, decided
        on the device: the gradients are dropped and neither the weights nor the optimizer state change."""
        out = {"grad_norm": optim.clip(self.accelerator, self.model, self.max_grad_norm)}
        if self.value_model is not None:
            out["value/grad_norm"] = optim.clip(self.accelerator, self.value_model, self.max_grad_norm)
        finite = finite_loss.to(self.device)
        for norm in out.values():
            finite = finite & torch.isfinite(norm.to(self.device))
        if self.world_size > 1:  # every rank skips the same steps (a loss is per rank, a norm global)
            finite = all_reduce(
                finite.to(torch.int32), self.world_size, self.device, op=dist.ReduceOp.MIN
            ).bool()
        skip = ~finite
        out["lr"] = optim.step(self.optimizer, self.scheduler, skip)
        if self.value_model is not None:
            optim.step(self.value_optimizer, self.value_scheduler, skip)
        self.global_step += 1
        out["skipped"] = skip
        return {k: v.detach().float().to(self.device) for k, v in out.items()}

    # -- weights and checkpoints ---------------------------------------------------------------

    def _manifest(self):
        manifest = module_manifest(self.accelerator.unwrap_model(self.model))
        if self.lora:  # merged weights under the base model's names
            manifest = base_manifest(manifest)
        return manifest

    def named_weights(self) -> Iterator[tuple[str, Tensor]]:
        """(HF name, full tensor) of the policy, one parameter at a time; every rank must iterate it."""
        return self.merged(iter_full_parameters(self.accelerator.unwrap_model(self.model)))

    def merged(self, named: Iterator[tuple[str, Tensor]]) -> Iterator[tuple[str, Tensor]]:
        """With LoRA the engines get merged weights under the base model's names (rlkit/learner/lora.py)."""
        if not self.lora:
            return named

        lora = self.cfg.model.lora
        return merged_weights(named, scale=lora.alpha / lora.rank)

    def export(self) -> Export:
        """The policy's weights as the rollout side receives them (rlkit.weights), with the log-prob probe
        the push is checked by (a push can copy every byte and still leave a drift)."""
        return Export(
            self.manifest, self.named_weights, probe=self.probe_logprobs, probe_dtype=self.compute_dtype,
            probe_vocab=self.probe_vocab,
        )  # fmt: skip

    @functools.cached_property
    def probe_vocab(self) -> int:
        """The ids the push's log-prob probe draws from: those the tokenizer and the embedding both know (a
        folder of weights alone, without a tokenizer, which the learner itself never needs: the embedding's)."""
        rows = self.accelerator.unwrap_model(self.model).get_input_embeddings().num_embeddings
        try:
            known = len(load_tokenizer(self.cfg.model.path))
        except (OSError, ValueError):
            known = rows
        return probe_vocab(known, rows)

    @torch.no_grad()
    def probe_logprobs(self, tokens: Tensor) -> Tensor:
        """rlkit.weights.Export.probe: the policy's log-probs of `tokens[:, 1:]` given their prefixes, at
        temperature 1 and without truncation, [N, L-1] float32 on the CPU; every rank must call it (FSDP2
        gathers inside the forward)."""
        ids = tokens.to(self.device)
        with eval_mode(self.model):
            logits = self.model(input_ids=ids, use_cache=False).logits.float()
        reshard(self.model)  # no backward follows to free the root's gathered parameters
        return torch.log_softmax(logits[:, :-1], -1).gather(-1, ids[:, 1:, None]).squeeze(-1).cpu()

    def nonfinite_parameters(self) -> list[str]:
        """Names of the parameters (policy and critic) holding NaN or inf, the same list on every rank (one
        collective; a sharded parameter is checked shard by shard). A host sync: call it outside the step."""
        named = [
            (f"{prefix}{n}", p)
            for prefix, model in (("", self.model), ("value_model.", self.value_model))
            if model is not None
            for n, p in self.accelerator.unwrap_model(model).named_parameters()
        ]
        local = [p.to_local() if hasattr(p, "to_local") else p for _, p in named]
        bad = torch.stack([~torch.isfinite(t.detach()).all() for t in local]).to(torch.int32)
        bad = all_reduce(bad, self.world_size, self.device, op=dist.ReduceOp.MAX).tolist()
        return [name for (name, _), b in zip(named, bad) if b]

    def refuse_nonfinite_checkpoint(self, what: str, run_dir: str | Path) -> None:
        """Refuse (`CheckpointError`) to write `what` from weights holding NaN or inf."""
        bad = self.nonfinite_parameters()
        if bad:
            raise CheckpointError(
                f"{what}: refusing to write it, parameters hold NaN or inf ({', '.join(bad[:3])}"
                f"{', ...' if len(bad) > 3 else ''}); the previous checkpoint ({latest_checkpoint(run_dir)}) "
                "is kept. Resume from it with a lower trainer.lr."
            )

    def stop_after_nonfinite_steps(self, step: int, metrics: dict[str, float]) -> None:
        """Stop the run (`NonFiniteError`) after `trainer.max_nonfinite_steps` skipped steps in a row."""
        teacher_path = self.algo.teacher.path if self.teacher is not None else None
        optim.check_nonfinite_run(self.nonfinite_run, step, metrics, self.cfg.trainer, teacher=teacher_path)

    def save_checkpoint(self, directory: str | Path) -> None:
        """`dir/model` (HF format), `dir/value_model` (critic), `dir/state`; every rank must call it."""
        checkpoint.save(self, directory)

    def load_checkpoint(self, directory: str | Path) -> None:
        """Restore what `save_checkpoint` wrote; every rank must call it, with the world size of the save."""
        checkpoint.load(self, directory)
