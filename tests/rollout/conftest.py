"""Shared fixtures for the rollout and model tests: one tiny checkpoint per test session."""

import pytest

from rlkit.models import make_tiny_checkpoint


@pytest.fixture(scope="session")
def tiny_ckpt(tmp_path_factory) -> str:
    """A random tiny Llama (hidden 64, 2 layers) with the real SmolLM2 tokenizer."""
    return make_tiny_checkpoint(tmp_path_factory.mktemp("tiny"), seed=0)


@pytest.fixture(scope="session")
def tiny_tokenizer(tiny_ckpt):
    from rlkit.models import load_tokenizer

    return load_tokenizer(tiny_ckpt)
