"""`model.dtype=auto`: bf16 only where the hardware computes it natively, resolved once before any check."""

import pytest
from hydra import compose, initialize_config_dir

from rlkit.config.schema import CONFIG_DIR, ConfigError, register_configs
from rlkit.learner import strategy
from rlkit.train import load_config

# Trimmed /proc/cpuinfo texts of three real CPU kinds (flags abridged by hand).
XEON_NO_BF16 = "processor\t: 0\nmodel name\t: Intel(R) Xeon(R) Processor\nflags\t\t: fpu sse2 avx2 avx512f avx512bw avx512_vnni\n"
EPYC_BF16 = "processor\t: 0\nmodel name\t: AMD EPYC 9R14\nflags\t\t: fpu avx2 avx512f avx512bw avx512_bf16 avx512_vnni\n"
SAPPHIRE = "processor\t: 0\nflags\t\t: fpu avx512f amx_tile amx_bf16 amx_int8\n"
GRAVITON3 = "processor\t: 0\nFeatures\t: fp asimd sve bf16 i8mm\n"
GRAVITON2 = "processor\t: 0\nFeatures\t: fp asimd atomics dcpop\n"


@pytest.mark.parametrize(
    "text, native",
    [
        (XEON_NO_BF16, False),
        (EPYC_BF16, True),
        (SAPPHIRE, True),
        (GRAVITON3, True),
        (GRAVITON2, False),
        ("", False),
    ],
)
def test_cpu_bf16_flag_is_read_from_cpuinfo(text, native):
    assert strategy.cpu_has_bf16(text) is native


def _compose(overrides):
    register_configs()
    with initialize_config_dir(str(CONFIG_DIR), version_base=None):
        return compose("config", overrides=overrides)


@pytest.mark.parametrize("native", [True, False])
def test_auto_resolves_both_dtypes_before_the_checks(monkeypatch, native):
    monkeypatch.setattr(strategy, "cpu_has_bf16", lambda cpuinfo=None: native)
    cfg = load_config(_compose(["+recipe=quickstart", "trainer.device=cpu"]))
    want = "bfloat16" if native else "float32"
    assert (cfg.model.dtype, cfg.model.compute_dtype) == (want, want)


def test_explicit_dtypes_are_kept_and_auto_compute_follows_them():
    cfg = load_config(_compose(["+recipe=quickstart", "model.dtype=float32", "model.compute_dtype=auto"]))
    assert (cfg.model.dtype, cfg.model.compute_dtype) == ("float32", "float32")
    cfg = load_config(_compose(["+recipe=quickstart", "model.dtype=bfloat16", "model.compute_dtype=float32"]))
    assert (cfg.model.dtype, cfg.model.compute_dtype) == ("bfloat16", "float32")


def test_a_wrong_dtype_names_the_choices_including_auto():
    with pytest.raises(ConfigError, match=r"model.dtype.*'fp8'.*auto.*float32.*bfloat16"):
        load_config(_compose(["+recipe=quickstart", "model.dtype=fp8"]))
