"""scripts/gpu_check.py on CPU, as far as it runs without a GPU: its arguments, the wheel list's closure, the
Hydra-free end-to-end config, the report's schema (the collectives and learner parts on a tiny model with
--allow-cpu), and the fsdp2 part in a process that sees only what the GPU machine has plus the carried
packages. The gpu-marked test runs the collectives part on NCCL."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "scripts"))

import gpu_check  # noqa: E402

pytestmark = (
    pytest.mark.slow
)  # runs scripts/gpu_check.py's parts in processes: `make test-fast` leaves it out


def test_arguments_are_checked():
    assert gpu_check.parse_args([]).parts == list(gpu_check.PARTS)
    assert gpu_check.parse_args(["--parts", "e2e"]).parts == ["e2e"]
    for bad in (["--parts", "e2e,bench"], ["--steps", "0"], ["--prepare", "a", "--bundle", "b"]):
        with pytest.raises(SystemExit):
            gpu_check.parse_args(bad)


def test_the_wheel_list_resolves_on_top_of_the_provided_packages():
    gaps = gpu_check.requirement_closure()
    assert set(gaps) == set(gpu_check.WHEELS) and not any(gaps.values()), gaps
    # The check can fail: without its dependencies in the list, datasets does not resolve.
    short = gpu_check.requirement_closure(("datasets",))
    assert {"pyarrow", "pandas", "xxhash"} <= set(short["datasets"])
    # Nothing the check must not need: no Hydra, no vLLM.
    assert not {"hydra-core", "vllm"} & {gpu_check._norm(n) for n in gpu_check.WHEELS}


def test_the_end_to_end_config_is_built_and_checked_without_hydra(tmp_path):
    from rlkit.models import make_tiny_checkpoint

    model = make_tiny_checkpoint(tmp_path / "m", hidden_size=32, num_layers=1)
    # One fresh process (so that an import of Hydra would show): cuda=True asks for trainer.device=cuda, which
    # the device check refuses by name on a machine without CUDA (and passes where there is one); cuda=False
    # passes every check.
    code = f"""
import sys
sys.path.insert(0, "scripts")
import gpu_check
from rlkit.config.schema import ConfigError
try:
    gpu_check.e2e_config({model!r}, {str(tmp_path / "run")!r}, steps=3, cuda=True)
except ConfigError as e:
    print("refused:", "trainer.device='cuda'" in str(e))
cfg = gpu_check.e2e_config({model!r}, {str(tmp_path / "run")!r}, steps=3, cuda=False)
print(cfg.data.path, cfg.trainer.strategy, cfg.trainer.steps, cfg.model.compute_dtype, cfg.rollout.engine)
print("hydra imported:", "hydra" in sys.modules)
"""
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr[-2000:]
    import torch

    assert out.stdout.splitlines() == [
        *([] if torch.cuda.is_available() else ["refused: True"]),
        "arithmetic fsdp2 3 float32 hf",
        "hydra imported: False",
    ]


def test_without_cuda_the_check_refuses_unless_told():
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA: the check would run every part (that is what it is for)")
    refused = gpu_check.run_check(gpu_check.parse_args([]))
    assert set(gpu_check.REPORT_KEYS) <= set(refused) and "no CUDA device" in refused["error"]


def test_report_schema_on_cpu(tmp_path):
    """The command line and its report, with parts that run on CPU too, on a tiny model: the collectives of a
    group of one (gloo here, which takes a host tensor; NCCL must refuse it) and the learner benchmark (the
    fsdp2 part: test_the_fsdp2_part_runs_with_the_carried_packages_alone)."""
    tiny = "--config tiny --samples 2 --prompt-len 8 --response-len 8 --updates 1"
    out = tmp_path / "r.json"
    args = ["--allow-cpu", "--parts", "collectives,learner", f"--learner-args={tiny}", "--out", str(out)]
    rc = subprocess.run(
        [sys.executable, "scripts/gpu_check.py", *args], cwd=ROOT, capture_output=True, text=True
    )
    report = json.loads(out.read_text())
    assert rc.returncode == 0, report
    assert set(gpu_check.REPORT_KEYS) <= set(report) and report["device"]["type"] in ("cpu", "cuda")
    learner = report["parts"]["learner"]
    assert learner["ok"] and learner["tokens_per_s"] > 0 and 0 < learner["mfu"] and "seconds" in learner
    assert report["versions"]["torch"] and list(report["parts"]) == ["collectives", "learner"]
    coll = report["parts"]["collectives"]
    cuda = report["device"]["type"] == "cuda"
    assert coll["ok"] and coll["as_expected"] and coll["backend"] == ("nccl" if cuda else "gloo"), coll
    assert coll["rlkit_learner_device"] == "ran: [12.0, 16.0, 3500000000.0]", (
        coll
    )  # the sum over a group of one


@pytest.mark.gpu
def test_on_a_gpu_nccl_refuses_a_host_tensor_and_rlkit_names_it_first():
    """Where it happens: an NCCL group of one takes no host tensor; rlkit's collectives
    refuse a host device by name and run on the learner's device."""
    done = subprocess.run(
        [sys.executable, "scripts/gpu_check.py", "--worker", "collectives"],
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    out = json.loads(done.stdout.strip().splitlines()[-1])
    assert out["backend"] == "nccl" and out["as_expected"], out
    assert "No backend type associated with device type cpu" in out["raw_host_tensor"], out
    assert "CollectiveDeviceError" in out["rlkit_host_device"], out


def gpu_machine_site(directory: Path) -> Path:
    """A site directory holding only the distributions of gpu_check.PROVIDED and what they need (links into
    this environment's site-packages): with `python -S` and it on PYTHONPATH, a process sees what the GPU
    machine has, and nothing else of this environment."""
    import importlib.metadata as md

    allowed = gpu_check._closure(gpu_check.PROVIDED)
    directory.mkdir(parents=True, exist_ok=True)
    for dist in md.distributions():
        if gpu_check._norm(dist.metadata["Name"]) not in allowed:
            continue
        roots = {Path(str(f)).parts[0] for f in dist.files or () if not str(f).startswith("..")}
        site = Path(dist.locate_file(""))
        for root in roots:
            if (site / root).exists() and not (directory / root).exists() and not root.endswith(".pth"):
                (directory / root).symlink_to(site / root)
    return directory


def test_the_fsdp2_part_runs_with_the_carried_packages_alone(tmp_path):
    """`PYTHONPATH=<repo>:bundle/python` is all the fsdp2 part needs on a machine with CUDA torch,
    transformers, accelerate and peft: in a process that sees only those distributions and what they need
    (`gpu_machine_site`), the part runs on a tiny model (gloo here), omegaconf and antlr4 come from the
    carried folders, and neither Hydra nor vLLM is imported."""
    gpu_check.carry_python_packages(tmp_path / "python")
    code = """
import json, sys
import antlr4, gpu_check, gpu_check_parts, omegaconf
args = gpu_check.parse_args(["--fsdp2-config", "tiny", "--peak-tflops", "1",
                             "--learner-args=--samples 2 --prompt-len 8 --response-len 8 --updates 1"])
result = gpu_check_parts.fsdp2_worker(args)
print(omegaconf.__file__)
print(antlr4.__file__)
print("hydra" in sys.modules, "vllm" in sys.modules)
print(json.dumps(result))
"""
    site = gpu_machine_site(tmp_path / "site")
    path = [str(ROOT), str(tmp_path / "python"), str(ROOT / "scripts"), str(site)]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(path)}
    out = subprocess.run(
        [sys.executable, "-S", "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True
    )
    assert out.returncode == 0, out.stderr[-3000:]
    omegaconf_file, antlr4_file, flags, report = out.stdout.splitlines()[-4:]
    assert omegaconf_file.startswith(str(tmp_path / "python")) and antlr4_file.startswith(
        str(tmp_path / "python")
    )
    assert flags == "False False"
    fsdp2 = json.loads(report)
    cuda = fsdp2["peak_cuda_memory_gb"] is not None
    assert (
        fsdp2["fsdp2"] and fsdp2["backend"] == ("nccl" if cuda else "gloo") and fsdp2["tokens_per_s"] > 0
    ), fsdp2
    # Every collective the learner makes ran on the group: its token counts (3 float64 values) among them.
    assert fsdp2["learner_collectives_on_the_group"] >= 3, fsdp2
    assert any(c.startswith("(3,) torch.float64") for c in fsdp2["collective_calls"]), fsdp2


def test_the_vllm_part_says_it_needs_vllm_where_there_is_none(monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "vllm" else real(name, *a)
    )
    out = gpu_check.run_vllm(gpu_check.parse_args(["--parts", "vllm"]), {"type": "cuda"})
    assert "needs vLLM" in out["skipped"]


def test_the_vllm_part_runs_each_measure_in_its_own_process_and_keeps_a_failed_ones_exit_code(monkeypatch):
    """Issue 61 items 3, 4, 7, 8: the probe in fp32 and bf16, sleep levels 1 and 2 (close()'s exit code), the
    verify seconds; one process each (vLLM's CuMem allocator: one sleep-mode engine per process)."""
    pytest.importorskip("vllm")
    commands = []

    def run(cmd, **kwargs):
        commands.append(cmd)
        # sleep level 2's process prints its line, then close() kills it (what item 4's crash would look like)
        code = -11 if cmd[2:6] == ["--measure", "sleep", "--level", "2"] else 0
        return subprocess.CompletedProcess(cmd, code, stdout='{"measured": 1}\n', stderr="Segmentation fault")

    monkeypatch.setattr(gpu_check.subprocess, "run", run)
    args = gpu_check.parse_args(["--parts", "vllm", "--vllm-model", "/m"])
    out = gpu_check.run_vllm(args, {"type": "cuda"})
    assert [c[2:] for c in commands] == [
        ["--measure", "probe", "--dtype", "float32", "--model", "/m"],
        ["--measure", "probe", "--dtype", "bfloat16", "--model", "/m"],
        ["--measure", "sleep", "--level", "1", "--model", "/m"],
        ["--measure", "sleep", "--level", "2", "--model", "/m"],
        ["--measure", "verify", "--model", "/m"],
    ]
    assert all(c[1].endswith("gpu_check_vllm.py") for c in commands)
    assert out["ok"] is False and out["failed"] == ["sleep-level-2"]
    level2 = out["measures"]["sleep-level-2"]
    assert (
        level2["exit_code"] == -11
        and level2["result"] == {"measured": 1}
        and "Segmentation" in level2["stderr"]
    )
