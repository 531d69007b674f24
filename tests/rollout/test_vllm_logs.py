"""vLLM's start-up notices about choices rlkit made are kept back, and nothing else: the records are built as
vLLM 0.32's own modules log them (logger name, format, arguments), without importing vLLM."""

import logging
import warnings

import torch

from rlkit.rollout.engines.vllm.logs import quiet_build_logs


def _collect(name: str) -> tuple[logging.Logger, list[str]]:
    seen: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: seen.append(record.getMessage())
    lg = logging.getLogger(name)
    lg.addHandler(handler)
    lg.setLevel(logging.DEBUG)
    return lg, seen


def test_the_engine_dtype_cast_notices_are_one_count_and_other_warnings_stay():
    utils, seen = _collect("vllm.model_executor.models.utils")
    cpu_worker, seen_worker = _collect("vllm.v1.worker.cpu_worker")
    platform, seen_platform = _collect("vllm.platforms.interface")
    fmt = "Attempted to load weight %s with dtype %s into parameter with dtype %s"
    with quiet_build_logs() as quieted:
        for name in ("model.embed_tokens.weight", "model.layers.0.mlp.up_proj.weight", "model.norm.weight"):
            utils.warning(fmt, name, torch.float32, torch.bfloat16)  # a bf16 engine from an fp32 checkpoint
        utils.warning("Some other problem with %s", "model.norm.weight")  # not a known notice: shown
        cpu_worker.warning("%s is not found in LD_PRELOAD. For best performance ...", "libtcmalloc")
        cpu_worker.error("%s is not found in LD_PRELOAD.", "libtcmalloc")  # an error always shows
        platform.warning("Unknown vLLM environment variable detected: %s", "VLLM_DIST_IDENT")  # vLLM's own
        platform.warning("Unknown vLLM environment variable detected: %s", "VLLM_TYPO")  # the user's: shown
    utils.warning(fmt, "model.norm.weight", torch.float32, torch.bfloat16)  # outside the build: shown
    assert seen == ["Some other problem with model.norm.weight", fmt % ("model.norm.weight", "torch.float32",
                    "torch.bfloat16")]  # fmt: skip
    assert seen_worker == ["libtcmalloc is not found in LD_PRELOAD."]
    assert seen_platform == ["Unknown vLLM environment variable detected: VLLM_TYPO"]
    assert sum(quieted.values()) == 5 and len(quieted) == 3


def test_the_ssm_cache_notice_is_kept_back_only_for_a_model_without_ssm_state():
    """vLLM 0.32's CPU platform on an AVX512-BF16 CPU logs this for every model; the backend is 'none' when the
    model has no SSM state (a dense or MoE transformer), a family name when it has one (still shown)."""
    cpu, seen = _collect("vllm.platforms.cpu")
    fmt = "Reset SSM cache type to float32 for accelerated GDN mamba backend '%s'."
    with quiet_build_logs() as quieted:
        cpu.warning(fmt, "none")
        cpu.warning(fmt, "nonemotron_h")  # a backend whose name starts alike: shown
        cpu.warning(fmt, "mamba2")
    assert seen == [fmt % "nonemotron_h", fmt % "mamba2"]
    assert list(quieted.values()) == [1]


def test_deprecation_warnings_of_vllm_modules_only_are_kept_back():
    def warn_from(module: str, category):
        exec(compile("warnings.warn('deprecated', category)", module, "exec"),
             {"__name__": module, "warnings": warnings, "category": category})  # fmt: skip

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with quiet_build_logs():
            warn_from("vllm.triton_utils.dispatcher", FutureWarning)
            warn_from("vllm", DeprecationWarning)
            warn_from("vllmx.other", FutureWarning)  # another package whose name starts alike: shown
            warn_from("vllm.config", UserWarning)  # not a deprecation: shown
        warn_from("vllm.triton_utils.dispatcher", FutureWarning)  # outside the build: shown
    assert [(w.category, w.filename) for w in caught] == [
        (FutureWarning, "vllmx.other"), (UserWarning, "vllm.config"),
        (FutureWarning, "vllm.triton_utils.dispatcher"),
    ]  # fmt: skip
