"""The vLLM rollout engine: colocated, one engine per training rank (the only module importing vllm).

Written against vllm==0.32.0 (pinned in pyproject's `vllm` extra). Each training process builds its
own `vllm.LLM` with tensor_parallel_size=1 and the `external_launcher` executor, so the engine runs
inside the training process on that process's GPU (no Ray, no server, no extra processes), as TRL's
colocate mode does. Between rollouts the engine sleeps (KV cache and weights freed or offloaded) so
the learner gets the memory; after every update the learner's weights are pushed in place.

Log-probs: the engine is built with `logprobs_mode="processed_logprobs"`, so the log-prob vLLM
returns for each sampled token is taken from the distribution it was sampled from (after
temperature, top-k and top-p; renormalised over the kept tokens), the same quantity the HF engine
returns. For greedy requests vLLM reports `log_softmax(logits)` (temperature 1).

The pure helpers (`sampling_params_from`, `request_outputs_to_batch`, `vllm_weight_name`) run on a
CPU and are tested against the real vllm package; `VLLMEngine` itself needs CUDA.
"""

from __future__ import annotations

import gc
import logging
import os
import time
from collections.abc import Iterable, Iterator

import torch
from torch import Tensor

from rlkit.batch import RolloutBatch
from rlkit.models import load_tokenizer, resolve_model
from rlkit.rollout.base import Sampling
from rlkit.rollout.common import check_generate_args, record_throughput, rows_to_batch

log = logging.getLogger(__name__)

# Prefixes that wrappers add to parameter names (activation checkpointing, FSDP1, DDP,
# torch.compile); vLLM's loaders know only the model's own names.
_WRAPPER_PREFIXES = ("_checkpoint_wrapped_module.", "_fsdp_wrapped_module.", "_orig_mod.", "module.")


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
        stop=list(sampling.stop) or None,
        include_stop_str_in_output=True,
        seed=sampling.seed if seed is None else seed,
        logprobs=0,
        skip_special_tokens=True,
    )


def request_outputs_to_batch(outputs, prompts: list[list[int]], n: int, pad_id: int) -> RolloutBatch:
    """Convert vLLM `RequestOutput`s (one per prompt, in prompt order) into a RolloutBatch.

    Each output must carry `n` completions with per-token logprobs (`SamplingParams.logprobs=0`);
    the log-prob of the token vLLM sampled at each position is read from its logprob dict (or
    `FlatLogprobs`). Raises `ValueError` when outputs and prompts do not line up, logprobs are
    missing, or a completion finished for another reason than "stop"/"length" (aborted, error).
    """
    if len(outputs) != len(prompts):
        raise ValueError(f"got {len(outputs)} request outputs for {len(prompts)} prompts")
    rows, texts, row_prompts = [], [], []
    for i, (out, prompt) in enumerate(zip(outputs, prompts)):
        if list(out.prompt_token_ids) != list(prompt):
            raise ValueError(f"request output {i} (id {out.request_id!r}) is not for prompts[{i}]")
        completions = sorted(out.outputs, key=lambda c: c.index)
        if len(completions) != n:
            raise ValueError(f"request output {i} has {len(completions)} completions, expected n={n}")
        for c in completions:
            if c.finish_reason not in ("stop", "length"):
                raise ValueError(f"prompts[{i}] sample {c.index} finished with {c.finish_reason!r}")
            tokens = list(c.token_ids)
            if c.logprobs is None or len(c.logprobs) != len(tokens):
                raise ValueError(
                    f"prompts[{i}] sample {c.index} has no per-token logprobs: "
                    f"SamplingParams.logprobs must be 0 (see sampling_params_from)"
                )
            logps = [position[token].logprob for token, position in zip(tokens, c.logprobs)]
            rows.append((tokens, logps, c.finish_reason))
            texts.append(c.text)
            row_prompts.append(list(prompt))
    return rows_to_batch(row_prompts, rows, texts, n, pad_id)


def vllm_weight_name(hf_name: str) -> str:
    """The name vLLM's `model.load_weights` expects for a transformers parameter name.

    vLLM's Llama/Qwen2/Qwen3/Mistral loaders take the checkpoint (transformers) names themselves
    and do the stacking (q/k/v -> qkv_proj, gate/up -> gate_up_proj) and tied-embedding handling
    internally, so only wrapper prefixes are stripped.
    """
    name = hf_name
    stripped = True
    while stripped:
        stripped = False
        for prefix in _WRAPPER_PREFIXES:
            if name.startswith(prefix):
                name = name[len(prefix) :]
                stripped = True
        name = name.replace("._checkpoint_wrapped_module.", ".").replace("._fsdp_wrapped_module.", ".")
    return name


def _launcher_env() -> tuple[int, int]:
    """Set the env:// variables the external launcher reads; returns (rank, world_size)."""
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    else:
        rank, world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    local_rank = int(os.environ.get("LOCAL_RANK", rank % max(1, torch.cuda.device_count())))
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(local_rank), WORLD_SIZE=str(world))
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    if "MASTER_PORT" not in os.environ:
        import socket

        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            os.environ["MASTER_PORT"] = str(s.getsockname()[1])
    return rank, world


class VLLMEngine:
    """A colocated vLLM engine for this training rank (CUDA only).

    Arguments: `model_path` (see `rlkit.models.resolve_model`), `dtype` ("bfloat16", "float16",
    "float32" or a torch dtype), `gpu_memory_utilization` (the fraction of the GPU vLLM may take,
    weights + KV cache; the learner needs the rest), `max_model_len` (None = the model's),
    `sleep_level` (1: offload weights to CPU and drop the KV cache; 2: drop both, weights must be
    pushed again before the next generate, which the trainer does after every update anyway),
    `enable_sleep_mode`, and any other `vllm.LLM` keyword argument.
    """

    name = "vllm"

    def __init__(
        self,
        model_path: str,
        *,
        dtype: str | torch.dtype = "bfloat16",
        seed: int = 0,
        gpu_memory_utilization: float = 0.3,
        max_model_len: int | None = None,
        enable_sleep_mode: bool = True,
        sleep_level: int = 1,
        max_num_batched_tokens: int = 4096,
        **llm_kwargs,
    ):
        if not torch.cuda.is_available():
            raise RuntimeError("rollout.engine=vllm needs a CUDA GPU; use rollout.engine=hf (or auto) on CPU")
        if sleep_level not in (1, 2):
            raise ValueError(f"sleep_level={sleep_level} must be 1 or 2")
        if not 0 < gpu_memory_utilization <= 1:
            raise ValueError(f"gpu_memory_utilization={gpu_memory_utilization} must be in (0, 1]")
        from vllm import LLM

        self.rank, _ = _launcher_env()
        directory, gguf_file = resolve_model(model_path)
        self.tokenizer = load_tokenizer(model_path)
        self.pad_id = self.tokenizer.pad_token_id
        self.llm = LLM(
            model=os.path.join(directory, gguf_file) if gguf_file else directory,
            tokenizer=directory,
            tensor_parallel_size=1,
            distributed_executor_backend="external_launcher",
            dtype=str(dtype).removeprefix("torch."),
            seed=seed + self.rank,
            gpu_memory_utilization=gpu_memory_utilization,
            max_model_len=max_model_len,
            enable_sleep_mode=enable_sleep_mode,
            enable_prefix_caching=True,
            logprobs_mode="processed_logprobs",
            max_num_batched_tokens=max_num_batched_tokens,
            **llm_kwargs,
        )
        self.context = self.llm.llm_engine.model_config.max_model_len
        self.sleep_enabled, self.sleep_level = enable_sleep_mode, sleep_level
        self._asleep = self._weights_awake = False
        self._weights_lost = False  # level-2 sleep dropped the weights; a push must come first
        self._calls = 0
        self._seed = seed

    def generate(self, prompts: list[list[int]], n: int, sampling: Sampling) -> RolloutBatch:
        """Sample `n` completions per prompt; the `n` rows of prompt i are contiguous. See HFEngine."""
        from vllm.inputs import TokensPrompt

        check_generate_args(prompts, n, self.context)
        if self._weights_lost:
            raise RuntimeError("VLLMEngine.generate after sleep(level=2) needs load_weights first")
        self.wake()
        # Every prompt gets its own seed (vLLM adds the sample index for its n samples), so no two
        # samples share a random stream; ranks differ, and unseeded calls advance with the call count.
        base = sampling.seed if sampling.seed is not None else self._seed * 1_000_003 + self._calls
        base = base * 7919 + self.rank * 104_729
        self._calls += 1
        params = [sampling_params_from(sampling, n, seed=base + i * n) for i in range(len(prompts))]
        t0 = time.perf_counter()
        outputs = self.llm.generate(
            [TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False
        )
        seconds = time.perf_counter() - t0
        return record_throughput(request_outputs_to_batch(outputs, prompts, n, self.pad_id), seconds)

    @torch.no_grad()
    def load_weights(self, named_tensors: Iterable[tuple[str, Tensor]]) -> int:
        """Push `(hf_name, full_tensor)` pairs into vLLM's model in place, one tensor at a time.

        Raises `RuntimeError` when nothing was pushed. Resets the prefix cache afterwards: cached
        KV blocks were computed with the old weights.
        """
        if self._asleep and not self._weights_awake:
            # The weights must be mapped on the GPU before writing into them (the KV cache stays freed).
            self.llm.wake_up(tags=["weights"])
            self._weights_awake = True
        counted = _Counter(named_tensors)

        def load(model):
            return len(model.load_weights(counted))

        loaded = self.llm.apply_model(load)[0]
        if counted.count == 0 or loaded == 0:
            raise RuntimeError(
                f"VLLMEngine.load_weights updated nothing (received {counted.count} tensors): the weight push did not happen"
            )
        self._weights_lost = False
        self.llm.reset_prefix_cache()
        return counted.count

    def sleep(self) -> None:
        """Free the KV cache (and offload or drop the weights, per `sleep_level`) for the learner."""
        if self.sleep_enabled and not self._asleep:
            self.llm.sleep(level=self.sleep_level)
            self._asleep, self._weights_awake = True, False
            self._weights_lost = self.sleep_level == 2

    def wake(self) -> None:
        if self._asleep:
            # After a push woke the weights, only the KV cache (and the scheduler) remain asleep.
            self.llm.wake_up(tags=["kv_cache", "scheduling"] if self._weights_awake else None)
            self._asleep = False

    def close(self) -> None:
        self.llm = None
        gc.collect()
        torch.cuda.empty_cache()


class _Counter:
    """Iterates `(name, tensor)` pairs with vLLM names and counts them."""

    def __init__(self, named_tensors):
        self.source, self.count = named_tensors, 0

    def __iter__(self) -> Iterator[tuple[str, Tensor]]:
        for name, tensor in self.source:
            self.count += 1
            yield vllm_weight_name(name), tensor


__all__ = ["VLLMEngine", "request_outputs_to_batch", "sampling_params_from", "vllm_weight_name"]
