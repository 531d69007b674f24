"""The parts of scripts/gpu_check.py that run in a process of their own (`--worker`): a process group of one,
set up as a launcher would (NCCL on CUDA, gloo on CPU), cannot be set up twice in one process. They import
torch, transformers, accelerate and rlkit's learner only (rlkit needs omegaconf and antlr4 besides: carried as
folders on PYTHONPATH, see gpu_check.py)."""

from __future__ import annotations

import argparse
import os
import tempfile
import time

from rlkit.collectives import free_port


def group_of_one(cuda: bool) -> None:
    """This process as the only rank of a process group: NCCL on CUDA (gloo on CPU), as a launcher sets it up."""
    os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", LOCAL_WORLD_SIZE="1", MASTER_ADDR="127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(free_port()))
    if cuda:
        import torch

        torch.cuda.set_device(0)


def collectives_worker(args) -> dict:
    """On one GPU: NCCL refuses a host tensor ("No backend type associated with device
    type cpu"), which the learner's token counts were; rlkit's collectives refuse a host device by name before
    NCCL does and place the tensor on the device they are given."""
    import torch
    import torch.distributed as dist

    from rlkit import collectives

    cuda = torch.cuda.is_available()
    group_of_one(cuda)
    dist.init_process_group("nccl" if cuda else "gloo", rank=0, world_size=1)
    device = torch.device("cuda", 0) if cuda else torch.device("cpu")
    out = {"backend": dist.get_backend()}

    def attempt(key, call):
        try:
            out[key] = f"ran: {call()}"
        except Exception as e:
            out[key] = f"refused: {type(e).__name__}: {str(e).splitlines()[0][:200]}"

    counts = [12.0, 16.0, 3.5e9]  # what learner.update all-reduces: real tokens, tokens run, FLOPs
    attempt("raw_host_tensor", lambda: dist.all_reduce(torch.tensor(counts, dtype=torch.float64)))
    attempt("rlkit_host_device", lambda: collectives.all_reduce(torch.tensor(counts), 2, "cpu").tolist())
    attempt("rlkit_learner_device", lambda: collectives.all_reduce(torch.tensor(counts), 2, device).tolist())
    dist.destroy_process_group()
    # On NCCL the first two must be refused and the last must run; on gloo all three run.
    expected = ("refused", "refused", "ran") if cuda else ("ran", "ran", "ran")
    got = tuple(
        out[k].split(":")[0] for k in ("raw_host_tensor", "rlkit_host_device", "rlkit_learner_device")
    )
    out["as_expected"] = got == expected
    return out


def fsdp2_accelerator(cuda: bool):
    """accelerate's FSDP2 on a group of one (rlkit.learner.make_accelerator runs one process plain): on CUDA
    accelerate turns FSDP on for a one-GPU group by itself; on CPU the learner's own switch does it."""
    from accelerate import Accelerator, FullyShardedDataParallelPlugin

    from rlkit.learner.strategy import enable_fsdp_on_cpu

    plugin = FullyShardedDataParallelPlugin(
        fsdp_version=2, auto_wrap_policy="transformer_based_wrap", reshard_after_forward=True,
        state_dict_type="SHARDED_STATE_DICT",
    )  # fmt: skip
    acc = Accelerator(cpu=not cuda, mixed_precision="bf16" if cuda else "no", fsdp_plugin=plugin)
    if not cuda:
        enable_fsdp_on_cpu(acc, plugin)
    assert acc.is_fsdp2, acc.distributed_type
    return acc


def through_the_backend(calls: list) -> None:
    """Every all-reduce the learner makes (a no-op in a world of one) also runs on the process group with the
    tensor rlkit.collectives would send: the learner's own collectives, real tensors, on NCCL."""
    import torch.distributed as dist

    from rlkit import collectives, metrics
    from rlkit.learner import batching, learner

    real = collectives.all_reduce

    def all_reduce(x, world, device, *, op=dist.ReduceOp.SUM, group=None):
        sent = collectives.placed(x, device, group).clone()
        dist.all_reduce(sent, op=op, group=group)
        calls.append(f"{tuple(x.shape)} {x.dtype} {x.device} -> {sent.device}")
        return real(x, world, device, op=op, group=group)

    for module in (learner, batching, metrics):
        module.all_reduce = all_reduce


def fsdp2_worker(args) -> dict:
    """The learner under FSDP2 on one device (NCCL on CUDA), on the Qwen2.5-0.5B shape with random weights:
    tokens/s, MFU and peak memory of `Learner.update`, every learner collective run on the group."""
    import bench_learner
    import torch
    from transformers import AutoModelForCausalLM

    from rlkit.config.schema import RLConfig
    from rlkit.flops import device_peak
    from rlkit.learner import Learner

    cuda = torch.cuda.is_available()
    group_of_one(cuda)
    ns = argparse.ArgumentParser()
    for flag, kind, default in (("--samples", int, 16), ("--prompt-len", int, 256), ("--response-len", int, 512),
                                ("--updates", int, 3)):  # fmt: skip
        ns.add_argument(flag, type=kind, default=default)
    ns.add_argument("--config", default=None)
    opts, _ = ns.parse_known_args(args.learner_args.split())
    config = bench_learner.build_config(args.fsdp2_config)
    calls: list = []
    with tempfile.TemporaryDirectory() as tmp:
        torch.manual_seed(0)
        AutoModelForCausalLM.from_config(config).save_pretrained(tmp)
        cfg = RLConfig()
        cfg.model.path, cfg.model.dtype = tmp, "float32"
        cfg.model.compute_dtype = "bfloat16" if cuda else "float32"
        cfg.trainer.device, cfg.trainer.strategy, cfg.trainer.lr = ("cuda" if cuda else "cpu"), "fsdp2", 1e-6
        learner = Learner(cfg, accelerator=fsdp2_accelerator(cuda))
    through_the_backend(calls)
    batch = bench_learner.random_batch(opts.samples, opts.prompt_len, opts.response_len, config.vocab_size, 0)
    tokens = int(batch.prompt_mask.sum() + batch.response_mask.sum())
    learner.update(batch)  # warm-up: FSDP's lazy init, kernels, the allocator
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    start, flops = time.perf_counter(), 0.0
    for _ in range(opts.updates):
        flops += float(learner.update(batch)["learner/flops"])
    if cuda:
        torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    peak, source = device_peak(learner.device, learner.compute_dtype, args.peak_tflops)
    import torch.distributed as dist

    return {
        "config": args.fsdp2_config, "backend": dist.get_backend(), "fsdp2": learner.accelerator.is_fsdp2,
        "compute_dtype": str(learner.compute_dtype).removeprefix("torch."), "rows": batch.num_samples,
        "tokens_per_update": tokens, "tokens_per_s": round(tokens * opts.updates / seconds, 1),
        "seconds_per_update": round(seconds / opts.updates, 3), "mfu": round(flops / (seconds * peak), 4),
        "peak_tflops": round(peak / 1e12, 3), "peak_source": source,
        "peak_cuda_memory_gb": round(torch.cuda.max_memory_allocated() / 2**30, 3) if cuda else None,
        "learner_collectives_on_the_group": len(calls), "collective_calls": sorted(set(calls)),
    }  # fmt: skip
