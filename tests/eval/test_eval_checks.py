"""`rlkit.eval`'s start-up checks (rlkit/rollout/evaluation.py check_config): eval.output must be writable
before any model loads, and every k of eval.ks must be at most the samples per prompt."""

import pytest
from run_helpers import read_only

from rlkit.config.schema import ConfigError, RLConfig
from rlkit.rollout.evaluation import check_config


@pytest.fixture
def read_only_folder(tmp_path):
    """A folder that cannot be written."""
    with read_only(tmp_path / "ro") as folder:
        yield folder


@pytest.mark.parametrize("where", ["ro/eval.json", "ro/new/eval.json", "a_file/eval.json"])
def test_an_unwritable_eval_output_is_a_start_up_error(read_only_folder, where):
    (read_only_folder.parent / "a_file").write_text("")
    cfg = RLConfig()
    cfg.eval.output = str(read_only_folder.parent / where)
    with pytest.raises(ConfigError) as e:
        check_config(cfg)
    assert f"eval.output={cfg.eval.output!r} cannot be written" in str(e.value)
    expected = "a_file is a file" if where.startswith("a_file") else f"{read_only_folder} is not writable"
    assert expected in str(e.value)


@pytest.mark.parametrize(
    ("output", "why"),
    [
        ("/sys/kernel/eval.json", "/sys/kernel is on a sysfs file system"),
        ("/sys/kernel/new/eval.json", "/sys/kernel is on a sysfs file system"),
        ("/proc/sys/eval.json", "/proc/sys is on a proc file system"),
        ("/dev/null", "/dev/null is not a regular file"),
    ],
)
def test_an_eval_output_on_a_kernel_interface_is_a_start_up_error(output, why):
    """sysfs answers access(2) "writable" for root, so before the check passed and the report failed (or
    reached a kernel file) at the end of the evaluation. Needs a mounted /sys and /proc."""
    cfg = RLConfig()
    cfg.eval.output = output
    with pytest.raises(ConfigError, match=f"eval.output={output!r} cannot be written: {why}"):
        check_config(cfg)


def test_a_k_above_the_samples_per_prompt_is_a_start_up_error():
    cfg = RLConfig()
    cfg.eval.ks, cfg.eval.n, cfg.eval.temperature = [1, 8], 4, 1.0
    with pytest.raises(
        ConfigError, match=r"eval.ks=\[1, 8\]: k=8 is above the 4 samples per prompt \(eval.n=4\)"
    ):
        check_config(cfg)
    cfg.eval.n = None  # rlkit.eval and training draw rollout.eval_group_size samples then
    cfg.rollout.eval_group_size = 2
    with pytest.raises(
        ConfigError, match=r"k=8 is above the 2 samples per prompt \(rollout.eval_group_size=2\)"
    ):
        check_config(cfg)
    cfg.eval.ks = [1, 2]
    check_config(cfg)
