"""vLLM's own LoRA serving against rlkit's merged-weights push: generation time with a LoRARequest (a new
adapter id each call, as after every update) and with plain weights (what the engine holds after a merged
push), same prompts and tokens. The merged push's own cost is `timing/weight_push_s` of a LoRA run.

    python scripts/bench_vllm_lora.py BASE_MODEL_DIR ADAPTER_DIR    # e.g. a run's checkpoints/step_N/adapter
"""

from __future__ import annotations

import os
import sys
import time


def main() -> None:
    base, adapter = sys.argv[1], sys.argv[2]
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    from vllm import LLM, SamplingParams
    from vllm.lora.request import LoRARequest

    start = time.perf_counter()
    llm = LLM(
        base, enforce_eager=True, enable_lora=True, max_lora_rank=64, dtype="float32", seed=0,
        enable_chunked_prefill=False, max_model_len=512,
    )  # fmt: skip
    print(f"engine build {time.perf_counter() - start:.1f} s")
    prompts = ["What is 2 + 3?"] * 16  # 16 x 32 tokens: one quickstart step
    sampling = SamplingParams(max_tokens=32, temperature=1.0, seed=0, ignore_eos=True)
    runs = [("plain weights (merged push)", None)] * 3 + [("LoRARequest, new adapter", "lora")] * 3
    for i, (label, kind) in enumerate(runs):
        request = LoRARequest(f"adapter{i}", i + 1, adapter) if kind else None  # a new id: loaded afresh
        start = time.perf_counter()
        llm.generate(prompts, sampling, lora_request=request, use_tqdm=False)
        print(f"{label}: {time.perf_counter() - start:.2f} s")


if __name__ == "__main__":
    main()
