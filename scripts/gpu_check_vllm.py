"""The measurements a first GPU run with vLLM must take (issue 61), each in a process of its own: vLLM's CuMem
allocator (sleep mode) takes one engine per process, and close()'s exit code is one of the results.

    python scripts/gpu_check_vllm.py --measure sleep --level 2 [--model DIR]    # one JSON line on stdout
    python scripts/gpu_check.py --parts vllm                                      # all of them, in order

What each measures (every part needs vLLM; `sleep` needs CUDA, where vLLM has its sleep mode):
- `probe --dtype float32|bfloat16` (item 3): the start-up probe's mean |engine - learner| log-prob gap of the
  engine as loaded, on the probe's fixed tokens, against the bound rlkit applies to that dtype (`probe_bound`);
- `sleep --level 1|2` (items 4 and 8): a colocated engine with sleep mode: sleep seconds, the GPU memory it
  frees, the push seconds, wake + generate seconds, the same tokens as before sleeping; then `close()`, whose
  process's exit code the caller records (a crash at close shows there, not here);
- `verify` (item 7): seconds of a verified push's digests, the engine's (`weight_digests`) and the learner's
  (`rlkit.weights.digest` of every pushed tensor), averaged over pushes.
Without `--model` a tiny random checkpoint is built (hidden 128, 2 layers, the SmolLM2 tokenizer): the timings
are then a lower bound; pass a real model directory for the numbers of a run.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
MEASURES = ("probe", "sleep", "verify")


def _model(path: str | None, work: Path) -> str:
    from rlkit.models import make_tiny_checkpoint

    return path or make_tiny_checkpoint(work / "model", hidden_size=128, num_layers=2, seed=0)


def _learner(path: str, dtype):
    import torch

    from rlkit.models import load_causal_lm

    device = "cuda" if torch.cuda.is_available() else "cpu"
    return load_causal_lm(path, dtype=dtype, device=device)


def measure_probe(path: str, dtype_name: str) -> dict:
    import torch

    from rlkit.rollout.engines.vllm import VLLMEngine
    from rlkit.verify import probe_bound, probe_gap, probe_tokens

    dtype = getattr(torch, dtype_name)
    engine = VLLMEngine(path, dtype=dtype_name, seed=0, enable_sleep_mode=False, max_model_len=256)
    try:
        model = _learner(path, dtype)
        tokens = probe_tokens(min(1000, model.config.vocab_size))
        with torch.no_grad():
            logits = model(tokens.to(model.device)).logits[:, :-1].float()
        learner = torch.log_softmax(logits, -1).gather(-1, tokens[:, 1:, None].to(model.device))[..., 0].cpu()
        gap = probe_gap(engine.prompt_logprobs(tokens), learner)
        bound = probe_bound(dtype)
        return {"dtype": dtype_name, "gap": gap, "bound": bound, "within_bound": gap <= bound,
                "model_runner": engine.model_runner}  # fmt: skip
    finally:
        engine.close()


def measure_sleep(path: str, level: int) -> dict:
    import torch

    from rlkit.rollout.engines.base import Sampling
    from rlkit.rollout.engines.vllm import VLLMEngine

    engine = VLLMEngine(path, dtype="float32", seed=0, sleep_level=level, max_model_len=256)
    out = {"level": level, "sleep_enabled": engine.sleep_enabled}
    cuda = torch.cuda.is_available()
    prompts, s = [[1, 2, 3, 4], [5, 6, 7]], Sampling(temperature=1.0, max_new_tokens=8, seed=3)
    before = engine.generate(prompts, 2, s)
    free = torch.cuda.mem_get_info()[0] if cuda else 0
    t0 = time.perf_counter()
    engine.sleep()
    out["sleep_s"] = time.perf_counter() - t0
    out["freed_gib"] = (torch.cuda.mem_get_info()[0] - free) / 2**30 if cuda else None
    model = _learner(path, torch.float32)
    t0 = time.perf_counter()
    engine.load_weights(model.named_parameters(), manifest=engine.manifest)
    out["push_s"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    after = engine.generate(prompts, 2, s)
    out["wake_and_generate_s"] = time.perf_counter() - t0
    out["same_tokens"] = bool(torch.equal(after.response_ids, before.response_ids))
    out["max_logprob_diff"] = float((after.rollout_logprobs - before.rollout_logprobs).abs().max())
    # Printed before close(): the caller reads this line and the process's exit code, which says whether
    # close() (vLLM's CuMem teardown with sleep mode) ended the process cleanly.
    print(json.dumps(out), flush=True)
    engine.close()
    return out


def measure_verify(path: str, pushes: int = 3) -> dict:
    import torch

    from rlkit.rollout.engines.vllm import VLLMEngine
    from rlkit.weights import digest

    engine = VLLMEngine(path, dtype="float32", seed=0, enable_sleep_mode=False, max_model_len=256)
    try:
        model = _learner(path, torch.float32)
        engine.load_weights(model.named_parameters(), manifest=engine.manifest)
        engine_s = learner_s = 0.0
        for _ in range(pushes):
            t0 = time.perf_counter()
            engine.weight_digests()
            engine_s += time.perf_counter() - t0
            t0 = time.perf_counter()
            for _, tensor in model.named_parameters():
                digest(tensor)
            learner_s += time.perf_counter() - t0
        params = sum(p.numel() for p in model.parameters())
        return {"pushes": pushes, "engine_digest_s": engine_s / pushes, "learner_digest_s": learner_s / pushes,
                "params": params}  # fmt: skip
    finally:
        engine.close()


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--measure", choices=MEASURES, required=True)
    ap.add_argument("--model", default=None, help="a model directory (default: a tiny random checkpoint)")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"], help="probe: the dtype")
    ap.add_argument("--level", type=int, default=1, choices=[1, 2], help="sleep: the sleep level")
    return ap.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    sys.path.insert(0, str(REPO))
    with tempfile.TemporaryDirectory(prefix="rlkit-gpu-check-vllm-") as work:
        path = _model(args.model, Path(work))
        if args.measure == "sleep":
            measure_sleep(path, args.level)  # prints its own line before close()
            return 0
        result = measure_probe(path, args.dtype) if args.measure == "probe" else measure_verify(path)
        print(json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
