"""Micro-benchmark of the learner: tokens/s of `Learner.update` and peak memory on a random batch.

    python scripts/bench_learner.py --config tiny --samples 16 --updates 3                 # CPU, seconds
    python scripts/bench_learner.py --preset tiny-qwen-vocab --tokens 8192 --json          # memory report
    python scripts/bench_learner.py --preset tiny-qwen-vocab --tokens 8192 --json --unchunked
    python scripts/bench_learner.py --config Qwen/Qwen2.5-0.5B --samples 64 --prompt-len 256 \\
        --response-len 1024 --updates 5 --dtype bfloat16 --gradient-checkpointing           # CUDA, bf16

`--config` / `--preset` is a preset name (`tiny`; `tiny-qwen-vocab`: two narrow layers with
Qwen2.5's 151,936-token vocabulary; `qwen2.5-0.5b` / `Qwen/Qwen2.5-0.5B`: the real model's
dimensions) or a directory / config.json of any transformers causal LM; weights are random (no
download). The first update is a warm-up and is not timed. Multi-GPU: `accelerate launch` it.

`--tokens N` builds a batch of about N real tokens with the quickstart's mixed lengths (prompts of
30 to 60 tokens, responses of 1 to 32) and sets the micro-batch budget to N. `--unchunked` runs the
previous learner path as the reference: full logits (`logprob_chunk_tokens=0`) on padded
micro-batches (`pack_sequences=false`); `--pack` turns packing on.

Peak memory on CPU: a thread samples the resident set size (/proc/self/statm) every millisecond
during the timed updates; `peak_memory_gb` is the highest sample minus the resident size just
before them (weights, optimizer state and batch already resident), i.e. what one update adds. Run
one configuration per process (each invocation is one), so no allocator state carries over. On
CUDA it is `torch.cuda.max_memory_allocated` minus the allocation before the timed updates.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import resource
import tempfile
import time
from pathlib import Path

import torch

PRESETS = {
    "tiny": dict(
        model_type="llama",
        vocab_size=512,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=4096,
        tie_word_embeddings=True,
    ),
    # Qwen2.5-0.5B's published config.json dimensions.
    "qwen2.5-0.5b": dict(
        model_type="qwen2",
        vocab_size=151936,
        hidden_size=896,
        intermediate_size=4864,
        num_hidden_layers=24,
        num_attention_heads=14,
        num_key_value_heads=2,
        max_position_embeddings=32768,
        rope_theta=1000000.0,
        rms_norm_eps=1e-6,
        tie_word_embeddings=True,
    ),
}
PRESETS["qwen/qwen2.5-0.5b"] = PRESETS["qwen2.5-0.5b"]
# Runs in seconds on a CPU while the vocabulary (the log-prob memory) is the real one.
PRESETS["tiny-qwen-vocab"] = dict(PRESETS["qwen2.5-0.5b"], hidden_size=64, intermediate_size=128)
PRESETS["tiny-qwen-vocab"].update(num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)


class RSSPeak:
    """Highest resident set size seen by a 1 ms sampling thread between start() and stop(), in bytes."""

    def __init__(self):
        import os
        import threading

        self._page = os.sysconf("SC_PAGE_SIZE")
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self.start_rss = self.peak = 0

    def rss(self) -> int:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * self._page

    def _run(self):
        while not self._stop.wait(0.001):
            self.peak = max(self.peak, self.rss())

    def start(self):
        self.start_rss = self.peak = self.rss()
        self._thread.start()

    def stop(self) -> int:
        self._stop.set()
        self._thread.join()
        return self.peak - self.start_rss


def quickstart_batch(tokens: int, vocab: int, seed: int):
    """Rows with the quickstart's mixed lengths (prompt 30-60, response 1-32), at most `tokens` real tokens."""
    from rlkit.batch import TrainBatch

    g = torch.Generator().manual_seed(seed)
    plens, rlens = [], []
    while True:
        p, r = int(torch.randint(30, 61, (1,), generator=g)), int(torch.randint(1, 33, (1,), generator=g))
        if sum(plens) + sum(rlens) + p + r > tokens:
            break
        plens.append(p)
        rlens.append(r)
    n, pw, rw = len(plens), max(plens), max(rlens)
    prompt_mask = torch.arange(pw)[None] >= (pw - torch.tensor(plens))[:, None]
    response_mask = torch.arange(rw)[None] < torch.tensor(rlens)[:, None]
    return TrainBatch(
        prompt_ids=torch.randint(0, vocab, (n, pw), generator=g) * prompt_mask,
        prompt_mask=prompt_mask,
        response_ids=torch.randint(0, vocab, (n, rw), generator=g),
        response_mask=response_mask,
        advantages=torch.randn(n, 1, generator=g).expand(n, rw).contiguous(),
    )


def build_config(name: str):
    from transformers import CONFIG_MAPPING, AutoConfig

    preset = PRESETS.get(name.lower())
    if preset is not None:
        kwargs = dict(preset)
        return CONFIG_MAPPING[kwargs.pop("model_type")](**kwargs)
    path = Path(name)
    if path.is_file():
        kwargs = json.loads(path.read_text())
        return CONFIG_MAPPING[kwargs.pop("model_type")](**kwargs)
    if path.is_dir():
        return AutoConfig.from_pretrained(path)
    raise ValueError(
        f"--config={name!r}: not a preset ({sorted(PRESETS)}), a config.json or a model directory"
    )


def random_batch(n: int, prompt_len: int, response_len: int, vocab: int, seed: int, fixed: bool = False):
    """Ragged lengths (half to full) so packing and trimming do real work; `fixed`: every response full
    (the fixed-length benchmark's shape: bench.py --fixed-length)."""
    from rlkit.batch import TrainBatch

    g = torch.Generator().manual_seed(seed)
    plens = torch.randint(prompt_len // 2, prompt_len + 1, (n,), generator=g)
    rlens = torch.randint(max(1, response_len // 2), response_len + 1, (n,), generator=g)
    if fixed:
        rlens = torch.full((n,), response_len)
    prompt_mask = torch.arange(prompt_len)[None] >= (prompt_len - plens)[:, None]
    response_mask = torch.arange(response_len)[None] < rlens[:, None]
    return TrainBatch(
        prompt_ids=torch.randint(0, vocab, (n, prompt_len), generator=g) * prompt_mask,
        prompt_mask=prompt_mask,
        response_ids=torch.randint(0, vocab, (n, response_len), generator=g),
        response_mask=response_mask,
        advantages=torch.randn(n, 1, generator=g).expand(n, response_len).contiguous(),
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", "--preset", default="tiny")
    ap.add_argument("--tokens", type=int, default=None, help="~N real tokens, quickstart lengths; budget N")
    ap.add_argument("--unchunked", action="store_true", help="reference: full logits, padded micro-batches")
    ap.add_argument("--chunk", type=int, default=512, help="logprob_chunk_tokens of the chunked path")
    ap.add_argument("--pack", action="store_true", help="padding-free packed micro-batches (pack_sequences)")
    ap.add_argument("--json", action="store_true", help="print one JSON line of results")
    ap.add_argument("--samples", type=int, default=16, help="rows per update (per process)")
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--response-len", type=int, default=64)
    ap.add_argument("--updates", type=int, default=3, help="timed updates (after one warm-up)")
    ap.add_argument("--max-tokens", type=int, default=8192, help="max_tokens_per_microbatch")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    ap.add_argument(
        "--compute-dtype",
        default=None,
        choices=["bfloat16", "float32"],
        help="model.compute_dtype (default: null)",
    )
    ap.add_argument("--gradient-checkpointing", action="store_true")
    ap.add_argument("--compile", action="store_true", help="trainer.compile: the policy's forward compiled")
    ap.add_argument("--kl-coef", type=float, default=0.0, help="> 0 adds the reference model and KL loss")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--fixed-length", action="store_true", help="every response --response-len tokens")
    ap.add_argument(
        "--profile", type=int, default=0, metavar="N",
        help="torch.profiler over the timed updates: the N ops with the most self CPU (and, on CUDA, device) time",
    )  # fmt: skip
    args = ap.parse_args()

    from transformers import AutoModelForCausalLM

    from rlkit.config.schema import RLConfig
    from rlkit.learner import Learner

    config = build_config(args.config)
    with tempfile.TemporaryDirectory() as tmp:
        torch.manual_seed(args.seed)
        AutoModelForCausalLM.from_config(config).save_pretrained(tmp)
        cfg = RLConfig()
        cfg.model.path, cfg.model.dtype, cfg.model.compute_dtype = tmp, args.dtype, args.compute_dtype
        cfg.model.gradient_checkpointing = args.gradient_checkpointing
        cfg.trainer.compile = args.compile
        cfg.trainer.lr, cfg.trainer.seed = 1e-6, args.seed
        cfg.trainer.max_tokens_per_microbatch = args.tokens or args.max_tokens
        cfg.trainer.logprob_chunk_tokens = 0 if args.unchunked else args.chunk
        cfg.trainer.pack_sequences = args.pack and not args.unchunked
        cfg.algo.kl_coef = args.kl_coef
        learner = Learner(cfg)
    acc = learner.accelerator
    n_params = sum(p.numel() for p in acc.unwrap_model(learner.model).parameters())
    if args.tokens:
        batch = quickstart_batch(args.tokens, config.vocab_size, args.seed)
    else:
        batch = random_batch(
            args.samples, args.prompt_len, args.response_len, config.vocab_size, args.seed, args.fixed_length
        )
    if args.kl_coef > 0:
        batch = type(batch)(
            **{**batch.tensor_fields(), "ref_logprobs": torch.full(batch.response_ids.shape, -5.0)}
        )
    tokens = int(batch.prompt_mask.sum() + batch.response_mask.sum()) * acc.num_processes

    learner.update(batch)  # warm-up: allocator, kernels, FSDP lazy init
    cuda = learner.device.type == "cuda"
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
    else:
        sampler = RSSPeak()
        sampler.start()
    profiler = contextlib.nullcontext()
    if args.profile:
        from torch.profiler import ProfilerActivity, profile

        profiler = profile(activities=[ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else []))
    start = time.perf_counter()
    reported, flops = [], 0.0
    with profiler as prof:
        for _ in range(args.updates):
            metrics = learner.update(batch)
            reported.append(float(metrics["learner/tokens_per_s"]))
            flops += float(metrics["learner/flops"])
        if cuda:
            torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    if args.profile and acc.is_main_process:
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=args.profile))
        if cuda:  # where the GPU's own time goes (the table above is the host's: launches, syncs, Python)
            print(prof.key_averages().table(sort_by="self_device_time_total", row_limit=args.profile))
    if cuda:
        added = torch.cuda.max_memory_allocated() - base
        peak = f"{torch.cuda.max_memory_allocated() / 2**30:.2f} GiB CUDA max_memory_allocated (rank 0)"
    else:
        added = sampler.stop()
        peak = f"{resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20:.2f} GiB CPU peak RSS (rank 0)"
    from rlkit.flops import device_peak

    peak_flops, peak_source = device_peak(learner.device, learner.compute_dtype)
    mfu = flops / (seconds * peak_flops * acc.num_processes)
    micro_batches = len(learner.plan(batch, 1)[0].micros)
    if args.json and acc.is_main_process:
        out = {
            "config": args.config,
            "path": "unchunked" if args.unchunked else ("chunked+packed" if args.pack else "chunked"),
            "tokens": tokens,
            "rows": batch.num_samples,
            "micro_batches": micro_batches,
            "compute_dtype": str(learner.compute_dtype).removeprefix("torch."),
            "mfu": round(mfu, 4),
            "peak_tflops": round(peak_flops / 1e12, 3),
            "peak_memory_gb": round(added / 2**30, 3),
            "tokens_per_s": round(tokens * args.updates / seconds, 1),
            "seconds_per_update": round(seconds / args.updates, 3),
        }
        if args.compile:  # the warm-up update compiled; none should compile during the timed ones
            out["compiled_graphs"] = int(metrics["learner/compiled_graphs"])
        print(json.dumps(out))
        return
    if acc.is_main_process:
        print(
            f"model {args.config} ({n_params / 1e6:.1f}M params), {acc.num_processes} process(es) on "
            f"{learner.device.type}, dtype {args.dtype}, compute {learner.compute_dtype}, "
            f"micro-batches per update {micro_batches}"
        )
        print(
            f"batch: {args.samples} x (prompt <= {args.prompt_len} + response <= {args.response_len}), {tokens} real tokens"
        )
        print(
            f"learner tokens/s: {tokens * args.updates / seconds:,.0f} (wall), {sum(reported) / len(reported):,.0f} (reported)"
        )
        print(f"seconds per update: {seconds / args.updates:.3f}")
        print(f"MFU: {100 * mfu:.1f}% of {peak_flops / 1e12:.3f} TFLOP/s per device ({peak_source})")
        print(f"peak memory: {peak}")


if __name__ == "__main__":
    main()
