"""Fixtures for the learner tests."""

import pytest
from learner_helpers import write_tiny_llama


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> str:
    return write_tiny_llama(tmp_path_factory.mktemp("tiny_llama"))
