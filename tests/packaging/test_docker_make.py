"""The Docker image and the Makefile's choice of torch wheel, read as text and run with a faked nvidia-smi:
no Docker daemon or GPU is needed."""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
DOCKER_RUN = re.compile(r"docker run\b[^`\n]*")


def test_the_image_has_the_c_compiler_triton_needs():
    lines = [line.strip() for line in (REPO / "Dockerfile").read_text().splitlines()]
    base = [line.split()[1] for line in lines if line.startswith("FROM ")]
    installs = " ".join(line for line in lines if line.startswith("RUN ") and "apt-get install" in line)
    assert len(base) == 1 and not base[0].endswith("-runtime"), base
    assert base[0].endswith("-devel") or re.search(r"\b(build-essential|gcc)\b", installs), (base, installs)


def documented_runs() -> list[tuple[str, str]]:
    """Every `docker run` of rlkit's image in the Dockerfile, the README and the docs."""
    out = []
    for page in [REPO / "Dockerfile", REPO / "README.md", *sorted((REPO / "docs").rglob("*.md"))]:
        text = re.sub(r"\n\s*(?=\+recipe)", " ", page.read_text())  # a line wrapped before its recipe
        for m in DOCKER_RUN.finditer(text):
            if " rlkit" in m.group(0):
                out.append((page.relative_to(REPO).as_posix(), m.group(0)))
    return out


def test_every_documented_docker_run_gives_nccl_its_shared_memory():
    runs = documented_runs()
    assert {page for page, _ in runs} >= {"Dockerfile", "README.md", "docs/getting-started/install.md"}, runs
    for page, cmd in runs:
        assert "--ipc=host" in cmd or "--shm-size" in cmd, (page, cmd)


def fake_nvidia_smi(tmp_path: Path, cuda: str) -> dict:
    """A PATH whose nvidia-smi lists one GPU, its header naming a driver that supports CUDA `cuda`."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    smi = bin_dir / "nvidia-smi"
    smi.write_text(
        '#!/bin/sh\nif [ "$1" = "-L" ]; then echo "GPU 0: NVIDIA H100 80GB HBM3"; exit 0; fi\n'
        f'echo "| NVIDIA-SMI 550.54.15   Driver Version: 550.54.15   CUDA Version: {cuda}     |"\n'
    )
    smi.chmod(0o755)
    return {**os.environ, "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}"}


def make_install(tmp_path: Path, cuda: str, *extra: str) -> subprocess.CompletedProcess:
    """`make -n install` (print, run nothing) into a fresh venv path, on a machine with that driver."""
    return subprocess.run(
        ["make", "-n", "install", f"VENV={tmp_path / 'venv'}", "PYTHON=python3", *extra],
        cwd=REPO, env=fake_nvidia_smi(tmp_path, cuda), capture_output=True, text=True,
    )  # fmt: skip


@pytest.mark.parametrize("cuda", ["12.4", "11.8"])
def test_make_refuses_the_cuda_13_wheels_on_an_older_driver(tmp_path, cuda):
    done = make_install(tmp_path, cuda)
    assert done.returncode != 0, done.stdout
    assert f"supports CUDA {cuda.split('.')[0]}" in done.stderr and "CUDA 13.0" in done.stderr, done.stderr
    assert "pip install" not in done.stdout


def test_make_installs_the_cuda_13_wheels_on_a_new_driver_or_what_it_is_told(tmp_path):
    done = make_install(tmp_path, "13.0")
    assert done.returncode == 0 and '"torch==2.13.0"' in done.stdout and "vllm==0.32.0" in done.stdout, done
    told = make_install(tmp_path, "12.4", "TORCH_SPEC=torch==2.13.0+cu126", "VLLM_SPEC=vllm==0.32.0+cu126")
    assert told.returncode == 0 and '"torch==2.13.0+cu126"' in told.stdout, told
