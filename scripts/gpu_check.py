"""A GPU check for a machine with CUDA torch, transformers, accelerate and peft but no network, no vLLM, no hub.

On a machine with network (this project's), build the bundle: rlkit's small pure-Python dependencies as
wheels, and the embedded model's tokenizer files (the tiny end-to-end model shares them):

    python scripts/gpu_check.py --prepare bundle/        # pip download --no-deps of WHEELS + the tokenizer

Carry the repository and bundle/ to the GPU machine, then (one JSON report, on stdout and in --out):

    python scripts/gpu_check.py --bundle bundle/ --out gpu_check.json

What it runs, each part independent (a failing part is reported with its error; the others still run):
- `learner`: tokens/s, MFU and peak CUDA memory of `Learner.update` on a Qwen2.5-0.5B-shaped model built
  from its config (random weights) in bf16 compute (scripts/bench_learner.py --config qwen2.5-0.5b);
- `e2e`: 3 GRPO training steps of a tiny random model end to end with the HF engine on CUDA, under FSDP2
  over NCCL in one process (the arithmetic task, the exact-answer reward), with its metrics;
- `tests`: the `gpu`-marked tests (pytest -m gpu), when pytest is installed.
Hydra is not needed: the end-to-end config is merged with omegaconf from the config groups' YAML files and
the quickstart_1digit recipe (`e2e_config`), then checked by the same rules and component checks as
`python -m rlkit.train` (whose module imports Hydra, so it is not imported). omegaconf is needed anyway
(rlkit.config.schema imports it): it and its antlr4 runtime are wheels; hydra-core is not carried.
`--allow-cpu` runs the same parts on CPU (gloo instead of NCCL), to test the script itself.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
# What the GPU machine already has (CUDA torch and the Hugging Face stack) and the wheels it is given.
PROVIDED = ("torch", "transformers", "accelerate", "peft")
# rlkit.data builds even the generated arithmetic task as a `datasets.Dataset`, so datasets and its
# dependencies come too (pyarrow, pandas and xxhash are binary wheels: prepare on the GPU machine's platform
# and Python version, or pass pip's --platform / --python-version through --pip-args).
WHEELS = (
    "datasets",
    "pyarrow",
    "pandas",
    "python-dateutil",
    "pytz",
    "tzdata",
    "six",
    "dill",
    "multiprocess",
    "xxhash",
    "fsspec",
    "omegaconf",
    "antlr4-python3-runtime",
    "PyYAML",
    "math-verify",
    "latex2sympy2_extended",
    "sympy",
    "mpmath",
    "safetensors",
    "tqdm",
)
PARTS = ("collectives", "fsdp2", "learner", "e2e", "tests")
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
)
REPORT_KEYS = ("schema", "started", "seconds", "device", "versions", "parts")


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    mode = ap.add_mutually_exclusive_group()
    mode.add_argument("--prepare", metavar="DIR", help="write the bundle (wheels + tokenizer) into DIR")
    mode.add_argument("--bundle", metavar="DIR", help="run the check with the bundle in DIR")
    mode.add_argument(
        "--list-wheels", action="store_true", help="print the wheel list and whether it resolves"
    )
    ap.add_argument(
        "--pip-args", default="", help="extra pip download arguments for --prepare (--platform ...)"
    )
    ap.add_argument("--out", metavar="FILE", help="also write the JSON report to FILE")
    ap.add_argument("--parts", default=",".join(PARTS), help=f"comma-separated subset of {','.join(PARTS)}")
    ap.add_argument("--allow-cpu", action="store_true", help="run on CPU when no CUDA device is visible")
    ap.add_argument("--steps", type=int, default=3, help="end-to-end training steps")
    ap.add_argument("--learner-args", default="--samples 16 --prompt-len 256 --response-len 512 --updates 3")
    ap.add_argument(
        "--fsdp2-config", default="qwen2.5-0.5b", help="the fsdp2 part's model (bench_learner preset)"
    )
    ap.add_argument(
        "--peak-tflops", type=float, default=None, help="peak of one device for MFU (default: rlkit's)"
    )
    ap.add_argument(
        "--worker", choices=["collectives", "fsdp2"], help=argparse.SUPPRESS
    )  # a part's own process
    args = ap.parse_args(argv)
    parts = [p for p in args.parts.split(",") if p]
    bad = [p for p in parts if p not in PARTS]
    if bad:
        ap.error(f"--parts: unknown {bad}; choose from {list(PARTS)}")
    if args.steps < 1:
        ap.error(f"--steps={args.steps} must be >= 1")
    args.parts = parts
    return args


def _norm(name: str) -> str:
    return name.lower().replace("_", "-").replace(".", "-")


def _requires(name: str) -> list[str]:
    """The distributions `name` needs here (installed metadata; extras and other platforms' markers left out)."""
    from packaging.requirements import Requirement

    out = []
    for r in importlib.metadata.requires(name) or ():
        req = Requirement(r)
        if req.marker is None or req.marker.evaluate({"extra": ""}):
            out.append(req.name)
    return out


def _closure(names) -> set[str]:
    seen, todo = set(), list(names)
    while todo:
        n = todo.pop()
        if _norm(n) in seen:
            continue
        seen.add(_norm(n))
        try:
            todo += _requires(n)
        except importlib.metadata.PackageNotFoundError:
            pass
    return seen


def requirement_closure(names=WHEELS, provided=PROVIDED) -> dict[str, list[str]]:
    """{wheel: what it needs, transitively, that neither the wheel list nor the provided packages (with
    everything they pull in) bring}, from the installed metadata: all lists empty = the list resolves."""
    covered = _closure(provided) | {_norm(n) for n in names}
    return {n: sorted(d for d in _closure([n]) if d not in covered) for n in names}


def prepare(directory: str, pip_args: str = "") -> dict:
    """pip download (no dependencies: the list is closed, `requirement_closure`) the wheels, and copy the
    embedded model's tokenizer files."""
    out = Path(directory)
    (out / "wheels").mkdir(parents=True, exist_ok=True)
    pins = [f"{n}=={importlib.metadata.version(n)}" for n in WHEELS]
    subprocess.run(
        [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "-d", str(out / "wheels"), *pip_args.split(), *pins],
        check=True,
    )  # fmt: skip
    sys.path.insert(0, str(REPO))
    from rlkit.models import load_tokenizer

    load_tokenizer("smollm2-135m").save_pretrained(out / "tokenizer")
    return {"wheels": sorted(p.name for p in (out / "wheels").iterdir()), "tokenizer": str(out / "tokenizer")}


def install_bundle(bundle: Path) -> list[str]:
    """Install the bundle's wheels that are not importable yet, from the bundle only (no index)."""
    todo = []
    for n in WHEELS:
        try:
            importlib.metadata.version(n)
        except importlib.metadata.PackageNotFoundError:
            todo.append(n)
    if todo:
        subprocess.run(
            [sys.executable, "-m", "pip", "install", "--no-index", "--find-links", str(bundle / "wheels"), *todo],
            check=True,
        )  # fmt: skip
    return todo


def versions() -> dict[str, str | None]:
    out = {"python": platform.python_version()}
    for n in (*PROVIDED, *WHEELS, "pytest"):
        try:
            out[n] = importlib.metadata.version(n)
        except importlib.metadata.PackageNotFoundError:
            out[n] = None
    return out


def device_info() -> dict:
    import torch

    if torch.cuda.is_available():
        return {
            "type": "cuda", "name": torch.cuda.get_device_name(0), "count": torch.cuda.device_count(),
            "cuda": torch.version.cuda, "bf16": torch.cuda.is_bf16_supported(),
        }  # fmt: skip
    return {"type": "cpu", "name": platform.processor() or platform.machine(), "count": os.cpu_count()}


def group_of_one(cuda: bool) -> None:
    """This process as the only rank of a process group: NCCL on CUDA (gloo on CPU), as a launcher sets it up."""
    os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", LOCAL_WORLD_SIZE="1", MASTER_ADDR="127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(_free_port()))
    if cuda:
        import torch

        torch.cuda.set_device(0)


def collectives_worker(args) -> dict:
    """Issue 44's finding 1 on one GPU: NCCL refuses a host tensor ("No backend type associated with device
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


def run_worker(args, part: str) -> dict:
    """A part in a process of its own (a process group of one cannot be set up twice in one process)."""
    cmd = [sys.executable, str(REPO / "scripts" / "gpu_check.py"), "--worker", part, "--fsdp2-config",
           args.fsdp2_config, f"--learner-args={args.learner_args}"]  # fmt: skip
    if args.peak_tflops is not None:
        cmd += ["--peak-tflops", str(args.peak_tflops)]
    done = subprocess.run(cmd, capture_output=True, text=True, env=_env(), cwd=REPO)
    if done.returncode != 0:
        raise RuntimeError(f"{part} failed ({done.returncode}): {done.stderr[-3000:]}")
    result = json.loads(done.stdout.strip().splitlines()[-1])
    if result.get("as_expected") is False:
        raise RuntimeError(f"{part}: not as expected: {result}")
    return result


def run_learner(args, device: dict) -> dict:
    """scripts/bench_learner.py on the Qwen2.5-0.5B shape in bf16 compute, one JSON line back."""
    cmd = [sys.executable, str(REPO / "scripts" / "bench_learner.py"), "--config", "qwen2.5-0.5b", "--json"]
    cmd += ["--dtype", "bfloat16", *args.learner_args.split()]
    done = subprocess.run(cmd, capture_output=True, text=True, env=_env(), cwd=REPO)
    if done.returncode != 0:
        raise RuntimeError(f"bench_learner failed ({done.returncode}): {done.stderr[-2000:]}")
    return {"command": " ".join(cmd[1:]), **json.loads(done.stdout.strip().splitlines()[-1])}


GROUPS = {"model": "smollm2_135m", "data": "arithmetic", "rollout": "default", "algo": "grpo", "reward": "math",
          "trainer": "default", "logger": "none"}  # fmt: skip


def e2e_config(model_dir: str, run_dir: str, *, steps: int, cuda: bool):
    """The end-to-end run's RLConfig without Hydra: the config groups' YAML files (configs/<group>/<name>.yaml)
    and the quickstart_1digit recipe's keys, merged with omegaconf in Hydra's order, then tiny sizes; checked
    by rlkit.config.rules.parse and every component's check_config, as `python -m rlkit.train` does."""
    from omegaconf import OmegaConf

    from rlkit.config.rules import parse

    parts = [
        OmegaConf.create({g: OmegaConf.load(REPO / "configs" / g / f"{n}.yaml")}) for g, n in GROUPS.items()
    ]
    recipe = OmegaConf.load(REPO / "recipes" / "quickstart_1digit.yaml")
    recipe.pop("defaults", None)
    overrides = {
        "model": {"path": model_dir, "dtype": "float32", "compute_dtype": "bfloat16" if cuda else "float32"},
        "data": {"num_train": 64, "num_eval": 8, "eval_size": 8},
        "rollout": {"max_new_tokens": 16, "engine": "hf"},
        "reward": {"num_workers": 1},
        # A random model earns no reward: every group is zero-std. Train those rows anyway, with a small
        # entropy bonus, so forward, backward and the optimizer step run with a non-zero gradient.
        "algo": {"mask_zero_std_groups": False, "entropy_coef": 1e-3},
        "trainer": {
            "steps": steps, "train_batch_size": 8, "eval_every": 0, "save_every": 0, "device": "cuda" if cuda else "cpu",
            "strategy": "fsdp2", "num_processes": 1, "run_dir": run_dir, "progress_bar": False,
        },
        "logger": {"backend": "none", "name": "gpu-check"},
    }  # fmt: skip
    merged = OmegaConf.merge(*parts, recipe, overrides)
    cfg = parse(OmegaConf.to_container(merged, resolve=True))
    check_e2e_config(cfg)
    return cfg


def check_e2e_config(cfg) -> None:
    """Every component's check_config, as rlkit.train's preflight runs them (not imported: it imports Hydra)."""
    from rlkit import envs, learner, rewards, trainer
    from rlkit.data import loading
    from rlkit.rollout import engines, producer
    from rlkit.rollout.remote import client

    for check in (
        loading.check_config, rewards.check_config, learner.check_config, engines.check_config,
        producer.check_config, trainer.check_config, client.check_config, envs.check_config, producer.check_inputs,
    ):  # fmt: skip
        check(cfg)


def run_e2e(args, bundle: Path | None, device: dict) -> dict:
    import torch

    from rlkit.models import make_tiny_checkpoint
    from rlkit.trainer import run

    cuda = device["type"] == "cuda"
    tokenizer = str(bundle / "tokenizer") if bundle is not None else "smollm2-135m"
    work = Path(tempfile.mkdtemp(prefix="rlkit-gpu-check-"))
    model = make_tiny_checkpoint(work / "model", tokenizer_path=tokenizer, hidden_size=128, num_layers=2)
    cfg = e2e_config(model, str(work / "run"), steps=args.steps, cuda=cuda)
    # One process under FSDP2: torch.distributed with NCCL on CUDA (gloo on CPU), as a launcher would set up.
    os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(_free_port()))
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    start = time.perf_counter()
    history = run(cfg)
    keys = (
        "reward/mean",
        "timing/step_s",
        "learner/tokens_per_s",
        "perf/learner_mfu",
        "mismatch/kl",
        "grad_norm",
    )
    return {
        "steps": len(history),
        "seconds": round(time.perf_counter() - start, 2),
        "backend": torch.distributed.get_backend() if torch.distributed.is_initialized() else None,
        "peak_cuda_memory_gb": round(torch.cuda.max_memory_allocated() / 2**30, 3) if cuda else None,
        "metrics": [{k: m.get(k) for k in keys} for m in history],
    }


def run_tests(args) -> dict:
    try:
        importlib.metadata.version("pytest")
    except importlib.metadata.PackageNotFoundError:
        return {"skipped": "pytest is not installed"}
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-m", "gpu", "tests", "-p", "no:cacheprovider"],
        capture_output=True, text=True, env=_env(), cwd=REPO,
    )  # fmt: skip
    return {"returncode": done.returncode, "summary": done.stdout.strip().splitlines()[-1:] or [""]}


def _env() -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    return env


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_check(args) -> dict:
    bundle = Path(args.bundle) if args.bundle else None
    installed = install_bundle(bundle) if bundle is not None else []
    if str(REPO) not in sys.path:
        sys.path.insert(0, str(REPO))
    device = device_info()
    report = {
        "schema": 1, "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "seconds": None,
        "device": device, "versions": versions(), "parts": {}, "installed_from_bundle": installed,
    }  # fmt: skip
    if device["type"] != "cuda" and not args.allow_cpu:
        report["error"] = "no CUDA device is visible (pass --allow-cpu to run the parts on CPU)"
        return report
    start = time.perf_counter()
    runners = {
        "collectives": lambda: run_worker(args, "collectives"),
        "fsdp2": lambda: run_worker(args, "fsdp2"),
        "learner": lambda: run_learner(args, device),
        "e2e": lambda: run_e2e(args, bundle, device),
        "tests": lambda: run_tests(args),
    }
    for part in args.parts:
        t0 = time.perf_counter()
        try:
            result = {"ok": True, **runners[part]()}
        except Exception as e:
            result = {
                "ok": False,
                "error": f"{type(e).__name__}: {e}",
                "traceback": traceback.format_exc()[-4000:],
            }
        result["seconds"] = round(time.perf_counter() - t0, 2)
        report["parts"][part] = result
    report["seconds"] = round(time.perf_counter() - start, 2)
    return report


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.worker:
        sys.path[:0] = [str(REPO), str(REPO / "scripts")]
        worker = collectives_worker if args.worker == "collectives" else fsdp2_worker
        print(json.dumps(worker(args)))
        return 0
    if args.prepare:
        print(json.dumps(prepare(args.prepare, args.pip_args), indent=1))
        return 0
    if args.list_wheels:
        gaps = requirement_closure()
        print(json.dumps({"provided": PROVIDED, "wheels": WHEELS, "unresolved": gaps}, indent=1))
        return 0 if not any(gaps.values()) else 1
    report = run_check(args)
    text = json.dumps(report, indent=1, default=str)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")
    return 0 if "error" not in report and all(p.get("ok") for p in report["parts"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
