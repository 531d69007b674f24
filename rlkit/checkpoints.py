"""Checkpoints: written atomically, verified before use, resumed exactly (the run directory's own files, lock and
guards are rlkit/rundir.py's).

    <run_dir>/checkpoints/step_<k>/{model, state, trainer_state.json, checksums.json, ...}   (.tmp-step_<k> while written)

- A resume continues exactly or not at all: a checkpoint written by another number of processes, or by a
  run whose model, algorithm, group size or critic differ (`RESUME_KEYS`), is refused naming both values.
- A step written again never deletes the old folder: it is kept aside, with a warning (`keep_aside`).
- A checkpoint can be trusted or is not used: `checksums.json`, written last into the temporary directory
  before the rename, records the size and sha256 of every other file (the HF export `model/` included).
  `trainer.resume=auto` takes the newest checkpoint that verifies (every file present, of its size and hash,
  the trainer state readable, the weights finite) and logs why it skipped any newer one; pruning never
  deletes a checkpoint that verifies before `keep_last` newer ones verify.
- A full disk is named: a checkpoint that does not fit is refused before it is written (`no_room_for`), and one
  that fails mid-write names the file and the device (`no_space_file`).
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import logging
import os
import shutil
from pathlib import Path

from rlkit.rundir import CHECKPOINT_RE, CHECKPOINTS, CHECKSUMS, TRAINER_STATE

log = logging.getLogger(__name__)


def checkpoint_state(checkpoint: str | Path) -> dict:
    return json.loads((Path(checkpoint) / TRAINER_STATE).read_text())


def check_world_size(checkpoint: str | Path, world_size: int) -> None:
    """A checkpoint resumes only with the number of processes that wrote it (the exact-resume guarantee:
    data sharding, sampling seeds and RNG states are per rank)."""
    saved = checkpoint_state(checkpoint).get("world_size")
    if saved is not None and int(saved) != world_size:
        raise RuntimeError(
            f"checkpoint {checkpoint} was written by {saved} processes, this run has {world_size}: it would not "
            f"continue exactly. Resume with {saved} processes (trainer.num_processes={saved}, or as many GPUs), "
            "or start a new run (another trainer.run_dir, or trainer.resume=none in a new directory)."
        )


# The keys a resumed run must share with the checkpoint it continues (its trainer_state.json records them as
# "resume_keys"): another model, algorithm, group size or critic would continue a different run silently.
RESUME_KEYS = (
    "model.path", "model.shape", "model.lora.rank", "algo.adv_estimator", "algo.policy_loss",
    "algo.value_model", "rollout.group_size",
)  # fmt: skip


def resume_record(config: dict, model_shape: dict) -> dict:
    """The values of RESUME_KEYS for a run's `config` (as `to_dict` gives it) and its model's shape."""
    record = {}
    for key in RESUME_KEYS:
        if key == "model.shape":
            record[key] = model_shape
            continue
        value = config
        for part in key.split("."):
            value = value.get(part) if isinstance(value, dict) else None
        record[key] = value
    return record


def check_resume_keys(checkpoint: str | Path, record: dict) -> None:
    """Refuse to resume from `checkpoint` with a config that differs from the one that wrote it in a key of
    RESUME_KEYS, naming the key and both values. A checkpoint written before rlkit recorded them is checked
    for what its files show (a critic, `value_model/`)."""
    checkpoint = Path(checkpoint)
    saved = checkpoint_state(checkpoint).get("resume_keys")
    if saved is None:
        saved = {"algo.value_model": (checkpoint / "value_model").is_dir()}
    for key in RESUME_KEYS:
        if key in saved and saved[key] != record.get(key):
            raise RuntimeError(
                f"cannot resume from {checkpoint}: {key} was {saved[key]!r} in the run that wrote it, this run "
                f"has {record.get(key)!r}; a resume continues the same run. Set {key} back, or start a new run "
                "(another trainer.run_dir)."
            )


class CheckpointError(RuntimeError):
    """A checkpoint cannot be written (no space left, non-finite weights) or cannot be trusted."""


def _complete(run_dir: str | Path) -> list[tuple[int, Path]]:
    """(step, path) of the complete checkpoints in `run_dir/checkpoints`, newest first (temp dirs ignored)."""
    root = Path(run_dir) / CHECKPOINTS
    if not root.is_dir():
        return []
    done = [
        (int(m.group(1)), p)
        for p in root.iterdir()
        if (m := CHECKPOINT_RE.match(p.name)) and (p / TRAINER_STATE).exists()
    ]
    return sorted(done, reverse=True)


def latest_checkpoint(run_dir: str | Path) -> Path | None:
    """The complete checkpoint with the highest step in `run_dir/checkpoints` (not verified)."""
    done = _complete(run_dir)
    return done[0][1] if done else None


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def write_checksums(directory: Path) -> None:
    """Record the size and sha256 of every file under `directory` in `CHECKSUMS`, after syncing each to disk
    (a crash after the rename then never leaves a zero-byte file that the manifest calls complete)."""
    files = {}
    for path in sorted(p for p in directory.rglob("*") if p.is_file() and p.name != CHECKSUMS):
        with open(path, "rb") as f:
            os.fsync(f.fileno())
        files[path.relative_to(directory).as_posix()] = {"size": path.stat().st_size, "sha256": _sha256(path)}
    (directory / CHECKSUMS).write_text(json.dumps({"files": files}, indent=1))


def _weight_files(checkpoint: Path) -> list[Path]:
    """The weights a checkpoint holds as safetensors: the HF exports and accelerate's model states."""
    files = [
        p
        for sub in ("model", "value_model", "adapter")
        for p in sorted((checkpoint / sub).glob("*.safetensors"))
    ]
    return files + sorted((checkpoint / "state").glob("model*.safetensors"))


def nonfinite_weights(checkpoint: str | Path) -> str | None:
    """The first `file: tensor` of the checkpoint's weights holding NaN or inf (or a file that is not
    readable safetensors), or None."""
    return damaged_weights(_weight_files(Path(checkpoint)), Path(checkpoint))


def damaged_weights(files: list[Path], root: Path) -> str | None:
    """The first of the safetensors `files` (named relative to `root`) that is not readable (empty,
    truncated, a damaged header) or holds NaN or inf, as `file: why`; None when all are sound."""
    import torch
    from safetensors import SafetensorError, safe_open

    for path in files:
        rel = path.relative_to(root)
        if not path.is_file():  # a link to a device, a named pipe: never opened
            return f"{rel} is not a regular file"
        try:
            with safe_open(path, framework="pt") as f:
                for name in f.keys():  # noqa: SIM118 (safe_open is not a dict)
                    t = f.get_tensor(name)
                    if t.is_floating_point() and not bool(torch.isfinite(t).all()):
                        return f"{rel}: tensor {name} holds NaN or inf"
        except (SafetensorError, OSError) as e:
            return f"{rel} is not readable safetensors ({e})"
    return None


def model_folder_problem(folder: str | Path) -> str | None:
    """What makes a model or adapter folder unusable (its `*.json` configs that do not parse, its
    `*.safetensors` weights that are unreadable or not finite), naming the file; None when sound."""
    folder = Path(folder)
    for config in sorted(folder.glob("*.json")):
        if not config.is_file():
            return f"{config.name} is not a regular file"
        try:
            json.loads(config.read_text())
        except (ValueError, UnicodeDecodeError) as e:
            return f"{config.name} is not valid JSON ({type(e).__name__}: {e})"
    return damaged_weights(sorted(folder.glob("*.safetensors")), folder)


def check_checkpoint(checkpoint: str | Path, *, full: bool = True) -> str | None:
    """What makes `checkpoint` unusable, or None. Every file `CHECKSUMS` lists must be there with its size
    and (`full`) its sha256, the trainer state must parse and (`full`) the weights must be finite. A
    checkpoint without `CHECKSUMS` (written before rlkit recorded them) is checked for what it can be."""
    checkpoint = Path(checkpoint)
    manifest = checkpoint / CHECKSUMS
    if manifest.exists():
        try:
            files = json.loads(manifest.read_text())["files"]
        except (ValueError, KeyError, TypeError):
            return f"{CHECKSUMS} is unreadable (truncated or empty)"
        for rel, want in files.items():
            path = checkpoint / rel
            if not path.is_file():
                return f"{rel} is missing"
            size = path.stat().st_size
            if size != want["size"]:
                return f"{rel} has {size} bytes, {CHECKSUMS} recorded {want['size']} (truncated or zero-byte)"
            if full and _sha256(path) != want["sha256"]:
                return f"{rel} does not match its sha256 in {CHECKSUMS} (corrupted)"
    elif not (checkpoint / TRAINER_STATE).exists():
        return f"no {TRAINER_STATE} (incomplete)"
    try:
        json.loads((checkpoint / TRAINER_STATE).read_text())["step"]
    except (ValueError, KeyError, TypeError):
        return f"{TRAINER_STATE} is unreadable (truncated or empty)"
    if full:
        bad = nonfinite_weights(checkpoint)
        if bad is not None:
            return bad
    return None


def newest_good_checkpoint(run_dir: str | Path) -> Path | None:
    """The newest complete checkpoint that verifies; each newer one that does not is named in the log.
    None when there is none at all; an error when there are checkpoints and none verifies."""
    done = _complete(run_dir)
    problems = []
    for _, path in done:
        problem = check_checkpoint(path)
        if problem is None:
            if problems:
                log.warning("resuming from the previous complete checkpoint %s", path)
            return path
        problems.append(f"{path}: {problem}")
        log.warning("checkpoint %s is not usable: %s; falling back to the previous checkpoint", path, problem)
    if problems:
        raise CheckpointError(
            "no usable checkpoint to resume from: " + "; ".join(problems) + ". Resume from another directory "
            "(trainer.resume=<checkpoint>) or start a new run (another trainer.run_dir)."
        )
    return None


def resume_path(run_dir: str | Path, resume: str) -> Path | None:
    """The checkpoint `trainer.resume` names: none, the newest one that verifies (auto), or a directory
    (refused, naming the bad file, when it does not verify)."""
    if resume == "none":
        return None
    if resume == "auto":
        return newest_good_checkpoint(run_dir)
    path = Path(resume)
    if not (path / TRAINER_STATE).exists():
        raise FileNotFoundError(
            f"trainer.resume={resume!r} is not a complete checkpoint (no {TRAINER_STATE})"
        )
    problem = check_checkpoint(path)
    if problem is not None:
        raise CheckpointError(f"trainer.resume={resume!r}: checkpoint {path} is not usable: {problem}")
    return path


def checkpoint_dirs(run_dir: str | Path, step: int) -> tuple[Path, Path]:
    """(temporary, final) directory of the checkpoint of `step`: written into the first, renamed to the second."""
    root = Path(run_dir) / CHECKPOINTS
    return root / f".tmp-step_{step}", root / f"step_{step}"


# What a full device looks like below Python's OSError. safetensors raises a SafetensorError that names the
# errno ("I/O error: No space left on device (os error 28)"); torch's stream writer (torch.save: accelerate's
# optimizer.bin and RNG states) a RuntimeError that does not ("basic_ios::clear: iostream error",
# "[enforce fail at inline_container.cc] unexpected pos N vs M", "PytorchStreamWriter failed writing file"),
# so the latter counts as "no space left" only when the device is then (almost) full: `_device_full`.
FULL_BYTES, FULL_FRACTION = 64 << 20, 0.05  # at most this free (and this fraction of the device) is full
ENOSPC_TEXTS = ("No space left on device", "os error 28")


WRITE_ERROR_TEXTS = ("basic_ios::clear", "iostream error", "unexpected pos", "PytorchStreamWriter")


def _device_full(path: Path) -> bool:
    """Whether the device holding `path` is full for a checkpoint: a write that failed for lack of space
    filled it to (nearly) the last block first, so what is left is a sliver; a device with more free than
    that failed for another reason, and its error is left as it is."""
    while not path.exists() and path != path.parent:
        path = path.parent
    usage = shutil.disk_usage(path)
    return usage.free <= min(FULL_BYTES, FULL_FRACTION * usage.total)


def _chain(e: BaseException) -> list[BaseException]:
    """`e` and the errors it was raised from (or while handling)."""
    chain = [e]
    while (nxt := chain[-1].__cause__ or chain[-1].__context__) is not None and nxt not in chain:
        chain.append(nxt)
    return chain


def _file_written(chain: list[BaseException], tmp: Path) -> str:
    """The file of `tmp` that was being written when the errors of `chain` were raised. torch's and
    safetensors' errors name none (and safetensors deletes its partial file), so the innermost frame of a
    traceback whose locals hold a path under `tmp` names it (`save_file(tensors, filename)`, `torch.save(obj,
    f)`); failing that, the file of `tmp` written last, or `tmp` itself."""
    root = os.path.abspath(tmp) + os.sep
    for err in reversed(chain):  # the deepest error first
        frames, tb = [], err.__traceback__
        while tb is not None:
            frames.append(tb.tb_frame)
            tb = tb.tb_next
        for frame in reversed(frames):
            for value in frame.f_locals.values():
                if isinstance(value, os.PathLike) or (isinstance(value, str) and len(value) < 4096):
                    path = os.fspath(value)
                    if isinstance(path, str) and os.path.abspath(path).startswith(root):
                        return path
    files = [p for p in tmp.rglob("*") if p.is_file()] if tmp.is_dir() else []
    return str(max(files, key=lambda p: p.stat().st_mtime_ns, default=tmp))


def no_space_file(e: BaseException, tmp: Path) -> str | None:
    """The file a write into `tmp` failed on when `e` means the device is full, else None: an `OSError`
    ENOSPC (anywhere in `e`'s chain), or torch's / safetensors' write error on a device that is full."""
    chain = _chain(e)
    for err in chain:
        if isinstance(err, OSError) and err.errno == errno.ENOSPC:
            return str(err.filename or _file_written(chain, tmp))
    texts = [f"{type(err).__name__}: {err}" for err in chain]
    if any(t in text for text in texts for t in ENOSPC_TEXTS) or (
        any(t in text for text in texts for t in WRITE_ERROR_TEXTS) and _device_full(tmp.parent)
    ):
        return _file_written(chain, tmp)
    return None


def _size(directory: Path) -> int:
    return sum(p.stat().st_size for p in directory.rglob("*") if p.is_file())


def no_room_for(final: Path) -> str | None:
    """Why checkpoint `final` must not be started, or None: the device has less free space than the previous
    checkpoint takes, so the write would fill it part way (the previous checkpoint is pruned only after the
    new one is complete, so both must fit)."""
    previous = latest_checkpoint(final.parent.parent)
    if previous is None:
        return None
    need, free = _size(previous), shutil.disk_usage(final.parent).free
    if free >= need:
        return None
    return (
        f"no space left on device writing {final}: the device holding {final.parent} has {free / 2**20:.1f} MiB "
        f"free and the previous checkpoint {previous} takes {need / 2**20:.1f} MiB. Nothing was written; "
        f"{previous} is intact. Free space (or lower trainer.keep_last) and resume with trainer.resume=auto."
    )


@contextlib.contextmanager
def writing_checkpoint(tmp: Path, *, main: bool):
    """Around the writing of a checkpoint into `tmp`: on any failure the main process removes `tmp`, and a
    full disk becomes a `CheckpointError` that says "no space left" and names the file, whichever layer
    raised it (`no_space_file`); the previous checkpoint is untouched (nothing is renamed or pruned before
    the write succeeds)."""
    try:
        yield
    except BaseException as e:
        full = no_space_file(e, tmp) if isinstance(e, Exception) else None  # before the partial files go
        if main:
            shutil.rmtree(tmp, ignore_errors=True)
        if full is not None:
            raise CheckpointError(
                f"no space left on device writing {full}: the partial checkpoint {tmp} was removed "
                f"and the previous checkpoint ({latest_checkpoint(tmp.parent.parent)}) is intact. Free space "
                "(or lower trainer.keep_last) and resume with trainer.resume=auto."
            ) from e
        raise


def commit_checkpoint(tmp: Path, final: Path, state: dict) -> None:
    """Write the trainer state, then the checksums of every file (last), then rename the checkpoint into place."""
    (tmp / TRAINER_STATE).write_text(json.dumps(state))
    write_checksums(tmp)
    if final.exists() or final.is_symlink():
        keep_aside(final)
    tmp.rename(final)
    fd = os.open(final.parent, os.O_RDONLY)  # the rename itself reaches the disk
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def keep_aside(final: Path) -> Path:
    """Move the checkpoint folder `final` (a step being written again: the run resumed from an earlier one,
    so `final` did not verify, or was passed over) out of the way, never deleting it: it is renamed to
    `<name>.replaced-<n>` (the first free n) with a warning naming both. Pruning never touches it."""
    n = 1
    while (aside := final.with_name(f"{final.name}.replaced-{n}")).exists() or aside.is_symlink():
        n += 1
    problem = (
        check_checkpoint(final, full=False) if final.is_dir() and not final.is_symlink() else "not a folder"
    )
    final.rename(aside)
    log.warning(
        "checkpoint %s is written again (%s): the old one is kept as %s; delete it when you have looked at it",
        final, f"it did not verify: {problem}" if problem else "it was not the one resumed from", aside,
    )  # fmt: skip
    return aside


def prune_checkpoints(run_dir: str | Path, keep: int) -> None:
    """Delete the checkpoints older than the `keep` newest that verify (0 keeps all). One that does not
    verify counts for nothing, so the last good checkpoint survives until `keep` newer ones are good;
    the check here is of sizes, not hashes (the resume checks those)."""
    if keep <= 0:
        return
    root = Path(run_dir) / CHECKPOINTS
    done = sorted(
        ((int(m.group(1)), p) for p in root.iterdir() if (m := CHECKPOINT_RE.match(p.name))), reverse=True
    )
    good = 0
    for _, path in done:
        if good >= keep:
            shutil.rmtree(path, ignore_errors=True)
        elif check_checkpoint(path, full=False) is None:
            good += 1
