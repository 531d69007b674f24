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
