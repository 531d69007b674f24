"""A full disk is named whatever layer raises it (issue #33, item 4), on a real, small tmpfs.

torch.save (accelerate's `optimizer.bin`, the RNG states) reports a full device as a RuntimeError
("unexpected pos N vs M" or "basic_ios::clear: iostream error"), safetensors as a SafetensorError, plain
Python as OSError(ENOSPC): each becomes `CheckpointError: no space left on device writing <file>`, the
temporary directory is removed and the previous checkpoint stays intact. A RuntimeError of the same text on a
device with room is left as it is. Before writing, a checkpoint is refused when the device has less free
space than the previous checkpoint takes.

The tmpfs is mounted by the test (CI runs as root); where `mount` is refused, the unit tests fall back to the
error torch really raises writing to /dev/full, with the device reported full, and the run test is skipped.
"""

import contextlib
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import run_helpers
import torch
from run_helpers import train

pytestmark = pytest.mark.slow  # trainer runs: `make test-fast` leaves it out

tiny = run_helpers.tiny  # the tiny model fixture


@contextlib.contextmanager
def tmpfs(directory: Path, size: str):
    """`directory` as a tmpfs of `size` (mount's syntax: 1m, 64m), or None when mounting is not allowed."""
    directory.mkdir(parents=True, exist_ok=True)
    try:
        mounted = (
            subprocess.run(
                ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(directory)], capture_output=True
            ).returncode
            == 0
        )
    except OSError:  # no mount command
        mounted = False
    if not mounted:
        yield None
        return
    try:
        yield directory
    finally:
        subprocess.run(["umount", "-l", str(directory)], check=False)


def _previous_checkpoint(run_dir: Path) -> Path:
    from rlkit.checkpoints import checkpoint_dirs, commit_checkpoint

    tmp, final = checkpoint_dirs(run_dir, 1)
    (tmp / "model").mkdir(parents=True)
    (tmp / "model" / "weights.bin").write_bytes(bytes(range(256)) * 256)  # 64 KiB
    commit_checkpoint(tmp, final, {"step": 1})
    return final


def _torch_save(path: Path):
    torch.save({"exp_avg": torch.ones(1 << 20)}, path)  # 4 MiB


def _safetensors_save(path: Path):
    from safetensors.torch import save_file

    save_file({"w": torch.ones(1 << 20)}, path)


def _plain_write(path: Path):
    path.write_bytes(b"\1" * (4 << 20))


WRITERS = {
    "torch.save": ("state/optimizer.bin", _torch_save, RuntimeError),
    "safetensors": ("model/model.safetensors", _safetensors_save, Exception),
    "open().write": ("state/schedulers.json", _plain_write, OSError),
}


@pytest.mark.parametrize("writer", list(WRITERS))
def test_a_write_error_on_a_full_device_is_named_whatever_layer_raises_it(tmp_path, monkeypatch, writer):
    from rlkit.checkpoints import CheckpointError, check_checkpoint, checkpoint_dirs, writing_checkpoint

    rel, write, raw_type = WRITERS[writer]
    with tmpfs(tmp_path / "disk", "1m") as disk:
        if disk is None:  # no mount here: torch's real error from /dev/full, the device reported full
            if writer != "torch.save":
                pytest.skip("mount -t tmpfs is not allowed here (CI runs it as root)")
            disk = tmp_path / "disk"
            usage = shutil.disk_usage(disk)
            monkeypatch.setattr(shutil, "disk_usage", lambda p: usage._replace(free=0))
            write = lambda path: (path.write_bytes(b"partial"), _torch_save(Path("/dev/full")))  # noqa: E731
        previous = _previous_checkpoint(disk)
        tmp, _ = checkpoint_dirs(disk, 2)
        (tmp / Path(rel).parent).mkdir(parents=True)
        with pytest.raises(Exception) as e, writing_checkpoint(tmp, main=True):
            write(tmp / rel)
        assert isinstance(e.value, CheckpointError), f"{type(e.value).__name__}: {e.value}"
        assert re.match(rf"no space left on device writing {re.escape(str(tmp / rel))}\b", str(e.value))
        assert isinstance(e.value.__cause__, raw_type)  # the layer's own error, kept as the cause
        if writer == "torch.save":
            assert re.search(r"unexpected pos|basic_ios::clear|PytorchStreamWriter", str(e.value.__cause__))
        assert not tmp.exists()
        assert sorted(p.name for p in (disk / "checkpoints").iterdir()) == ["step_1"]
        assert check_checkpoint(previous) is None


def test_the_same_runtime_error_on_a_device_with_room_keeps_its_own_name(tmp_path):
    """The free space decides: torch's text alone does not make a full disk (tmp_path has room)."""
    from rlkit.checkpoints import checkpoint_dirs, writing_checkpoint

    tmp, _ = checkpoint_dirs(tmp_path, 1)
    tmp.mkdir(parents=True)
    assert shutil.disk_usage(tmp).free > 64 << 20
    with pytest.raises(RuntimeError) as e, writing_checkpoint(tmp, main=True):
        raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 576 vs 534")
    assert type(e.value) is RuntimeError and "no space" not in str(e.value)
    assert not tmp.exists()


def test_a_run_on_a_full_tmpfs_names_the_file_keeps_the_previous_checkpoint_and_refuses_early(
    tiny, tmp_path, monkeypatch
):
    """A run whose disk fills while step 2's checkpoint is written (another process takes the space once
    step 1's checkpoint is there): CheckpointError naming a file of .tmp-step_2, step_1 intact. Resumed with
    the disk still that full, step 2's checkpoint is refused before anything is written."""
    from rlkit.checkpoints import CheckpointError, check_checkpoint
    from rlkit.learner import checkpoint

    with tmpfs(tmp_path / "disk", "96m") as disk:
        if disk is None:
            pytest.skip("mount -t tmpfs is not allowed here (CI runs it as root)")
        run_dir = disk / "r"
        real_save = checkpoint.save
        step_1 = run_dir / "checkpoints" / "step_1"

        def save_while_the_disk_fills(learner, directory):
            if Path(directory).name == ".tmp-step_2":
                size = sum(p.stat().st_size for p in step_1.rglob("*") if p.is_file())
                # Leave room for half of a checkpoint, so the write fails part way, in whatever layer.
                free = shutil.disk_usage(disk).free
                with open(disk / "ballast", "wb") as f:
                    f.truncate(0)
                    f.write(b"\0" * (free - size // 2))
            return real_save(learner, directory)

        monkeypatch.setattr(checkpoint, "save", save_while_the_disk_fills)
        args = ("trainer.steps=2", "trainer.save_every=1", "trainer.eval_at_start=false")
        with pytest.raises(Exception) as e:
            train(tiny, run_dir, *args)
        assert isinstance(e.value, CheckpointError), f"{type(e.value).__name__}: {e.value}"
        named = re.match(r"no space left on device writing (\S+): ", str(e.value))
        assert named and f"{run_dir}/checkpoints/.tmp-step_2/" in named.group(1), str(e.value)
        assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == ["step_1"]
        assert check_checkpoint(step_1) is None

        with pytest.raises(CheckpointError) as e:  # the disk is still full: refused before writing
            train(tiny, run_dir, *args, "trainer.resume=auto")
        assert re.match(
            rf"no space left on device writing {re.escape(str(run_dir))}/checkpoints/step_2: ", str(e.value)
        )
        assert "MiB free and the previous checkpoint" in str(e.value)
        assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == ["step_1"]
        assert check_checkpoint(step_1) is None
