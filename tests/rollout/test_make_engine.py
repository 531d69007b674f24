import logging

import pytest
import torch

from rlkit.rollout import make_engine
from rlkit.rollout.base import RolloutEngine
from rlkit.rollout.hf import HFEngine


def test_auto_picks_hf_without_cuda_and_logs_why(tiny_ckpt, caplog):
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA: auto would pick vLLM")
    with caplog.at_level(logging.INFO, logger="rlkit.rollout"):
        engine = make_engine("auto", tiny_ckpt, dtype="float32", seed=0)
    assert isinstance(engine, HFEngine) and isinstance(engine, RolloutEngine)
    assert "picked hf (no CUDA device)" in caplog.text


def test_unknown_engine_and_dtype_name_the_choices(tiny_ckpt):
    with pytest.raises(ValueError, match=r"rollout.engine='sglang' is not one of \('auto', 'hf', 'vllm'\)"):
        make_engine("sglang", tiny_ckpt)
    with pytest.raises(ValueError, match="dtype='float8'"):
        make_engine("hf", tiny_ckpt, dtype="float8")


def test_vllm_without_cuda_fails_clearly(tiny_ckpt):
    if torch.cuda.is_available():
        pytest.skip("CUDA present")
    pytest.importorskip("vllm", exc_type=ImportError)
    with pytest.raises(RuntimeError, match="needs a CUDA GPU"):
        make_engine("vllm", tiny_ckpt)
