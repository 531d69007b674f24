"""vLLM for the tests. `make test` installs vLLM and sets RLKIT_REQUIRE_VLLM=1: there a vLLM that does not
import is an error (the vLLM tests must run), never a silent skip. Elsewhere (a plain `pytest` in an
environment without vLLM) the tests that need it are skipped."""

import importlib
import os

import pytest


def import_vllm():
    """The `vllm` module; without it, an ImportError under RLKIT_REQUIRE_VLLM=1, else a skip."""
    if os.environ.get("RLKIT_REQUIRE_VLLM") == "1":
        return importlib.import_module("vllm")
    return pytest.importorskip("vllm", exc_type=ImportError)


def _cuda() -> bool:
    import torch

    return torch.cuda.is_available()


# On CUDA vLLM's sleep mode (on by default there) puts the engine's memory in its CuMem allocator, which takes
# one engine per process ("CuMem allocator can only be used for one instance per process",
# vllm/v1/worker/gpu_worker.py); the engine tests keep two alive and test no sleep, so on CUDA they build theirs
# without it. Sleep mode itself is tested on a GPU by tests/rollout/test_vllm_gpu.py (one engine, `gpu` marker).
TEST_ENGINE = {"enable_sleep_mode": False} if _cuda() else {}
