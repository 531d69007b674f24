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
- `vllm` (needs vLLM; skipped, saying so, without it): scripts/gpu_check_vllm.py's measurements, each in its
  own process: the start-up probe's gap in fp32 and bf16 against rlkit's bound, sleep mode at levels 1 and 2
  (sleep/wake/push seconds, memory freed, close()'s exit code), a verified push's digest seconds;
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
import importlib.util
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
# No wheel of the pinned release on PyPI (antlr4-python3-runtime 4.9.3, which omegaconf 2.3 pins): its sdist,
# pure Python, which pip installs offline from the bundle.
SOURCE_ONLY = ("antlr4-python3-runtime",)
# What rlkit's learner imports beyond torch, transformers and accelerate (rlkit.config: omegaconf), as packages.
CARRIED = ("omegaconf", "antlr4")
PARTS = ("collectives", "fsdp2", "learner", "e2e", "vllm", "tests")
# The `vllm` part's measurements (scripts/gpu_check_vllm.py), each in a process of its own, in this order: the
# probe's gap in fp32 and bf16 (issue 61 item 3), sleep mode at levels 1 and 2 with close()'s exit code (items 4
# and 8), a verified push's digest seconds (item 7).
VLLM_MEASURES = (
    ("probe-float32", ["--measure", "probe", "--dtype", "float32"]),
    ("probe-bfloat16", ["--measure", "probe", "--dtype", "bfloat16"]),
    ("sleep-level-1", ["--measure", "sleep", "--level", "1"]),
    ("sleep-level-2", ["--measure", "sleep", "--level", "2"]),
    ("verify", ["--measure", "verify"]),
)
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
    ap.add_argument("--vllm-model", default=None, help="the vllm part's model (default: a tiny random one)")
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


def carry_python_packages(directory: Path) -> list[str]:
    """Copy the installed pure-Python packages the `collectives` and `fsdp2` parts need beyond the GPU machine's
    own (`CARRIED`) into `directory`, import-ready: `PYTHONPATH=<repo>:<directory>` then needs no pip."""
    import importlib
    import shutil

    directory.mkdir(parents=True, exist_ok=True)
    for name in CARRIED:
        source = Path(importlib.import_module(name).__file__).parent
        shutil.copytree(
            source, directory / name, dirs_exist_ok=True, ignore=shutil.ignore_patterns("__pycache__")
        )
    return sorted(CARRIED)


def prepare(directory: str, pip_args: str = "") -> dict:
    """pip download (no dependencies: the list is closed, `requirement_closure`) the wheels, copy the packages
    the learner parts need as folders (`carry_python_packages`) and the embedded model's tokenizer files."""
    out = Path(directory)
    (out / "wheels").mkdir(parents=True, exist_ok=True)
    pins = [f"{n}=={importlib.metadata.version(n)}" for n in WHEELS if n not in SOURCE_ONLY]
    subprocess.run(
        [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "-d", str(out / "wheels"), *pip_args.split(), *pins],
        check=True,
    )  # fmt: skip
    sources = [f"{n}=={importlib.metadata.version(n)}" for n in SOURCE_ONLY]  # pure Python: any platform
    subprocess.run(
        [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary=:all:", "-d", str(out / "wheels"), *sources],
        check=True,
    )  # fmt: skip
    carry_python_packages(out / "python")
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


def run_vllm(args, device: dict) -> dict:
    """The measurements of VLLM_MEASURES, each in its own process (vLLM's CuMem allocator takes one sleep-mode
    engine per process; close()'s exit code is a result). Needs vLLM (the CUDA wheel; `sleep` needs CUDA too:
    on CPU the engine has no sleep mode and says so). Each gives its exit code and its JSON line."""
    if importlib.util.find_spec("vllm") is None:
        return {"skipped": "needs vLLM (pip install rlkit[vllm]): the probe, sleep and verify measurements"}
    out = {"needs": "vllm", "measures": {}}
    for name, flags in VLLM_MEASURES:
        cmd = [sys.executable, str(REPO / "scripts" / "gpu_check_vllm.py"), *flags]
        if args.vllm_model:
            cmd += ["--model", args.vllm_model]
        t0 = time.perf_counter()
        done = subprocess.run(cmd, capture_output=True, text=True, env=_env(), cwd=REPO)
        lines = [ln for ln in done.stdout.strip().splitlines() if ln.startswith("{")]
        result = {"exit_code": done.returncode, "seconds": round(time.perf_counter() - t0, 2),
                  "result": json.loads(lines[-1]) if lines else None}  # fmt: skip
        if done.returncode != 0:
            result["stderr"] = done.stderr[-3000:]
        out["measures"][name] = result
    # A measure that failed (or whose close() ended its process badly) fails the part, its numbers kept.
    out["failed"] = [n for n, m in out["measures"].items() if m["exit_code"] != 0]
    out["ok"] = not out["failed"]
    return out


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
        "vllm": lambda: run_vllm(args, device),
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
        import gpu_check_parts

        worker = (
            gpu_check_parts.collectives_worker
            if args.worker == "collectives"
            else gpu_check_parts.fsdp2_worker
        )
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
