import logging

import pytest
from vllm_import import import_vllm

from rlkit.rollout.engines import make_engine
from rlkit.rollout.engines.base import RolloutEngine
from rlkit.rollout.engines.hf import HFEngine


def test_auto_picks_hf_and_logs_why_when_vllm_cannot_run_the_model(tiny_ckpt, caplog):
    """The session's tiny model has head_dim 16: vLLM's CPU attention cannot run it (CUDA can)."""
    vllm = import_vllm()
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        pytest.skip(f"vLLM platform is {vllm.platforms.current_platform.device_type}")
    with caplog.at_level(logging.INFO, logger="rlkit.rollout"):
        engine = make_engine("auto", tiny_ckpt, dtype="float32", seed=0)
    assert isinstance(engine, HFEngine) and isinstance(engine, RolloutEngine)
    assert "picked hf (vLLM's CPU attention does not support head_dim=16)" in caplog.text


def test_auto_would_pick_vllm_for_a_supported_model(tmp_path):
    import_vllm()
    from rlkit.models import make_tiny_checkpoint
    from rlkit.rollout.engines import vllm_usable

    ckpt = make_tiny_checkpoint(tmp_path, hidden_size=128, num_layers=1)
    usable, why = vllm_usable(ckpt)
    assert usable, why
    assert "vLLM imports and runs on its" in why


def test_unknown_engine_and_dtype_name_the_choices(tiny_ckpt):
    with pytest.raises(ValueError, match=r"rollout.engine='sglang' is not one of \['auto', 'hf', 'vllm'\]"):
        make_engine("sglang", tiny_ckpt)
    with pytest.raises(ValueError, match="dtype='float8'"):
        make_engine("hf", tiny_ckpt, dtype="float8")


def test_vllm_on_a_model_it_cannot_run_fails_clearly(tiny_ckpt):
    vllm = import_vllm()
    if not vllm.platforms.current_platform.is_cpu():
        pytest.skip("CUDA runs head_dim 16")
    with pytest.raises(RuntimeError, match="rollout.engine=vllm cannot run here: .*head_dim=16"):
        make_engine("vllm", tiny_ckpt)
