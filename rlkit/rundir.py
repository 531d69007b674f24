"""The run directory: its layout and its guards (the only module that knows where files go).

    <run_dir>/rlkit.lock  metrics.jsonl  samples.jsonl  config.json  curves.png  .hydra/
    <run_dir>/checkpoints/step_<k>/{model, state, trainer_state.json, ...}   (.tmp-step_<k> while written)

The guards are checked on rank 0 before any model loads:

- One run per directory: `RunDirLock` holds an exclusive `flock` on `<run_dir>/rlkit.lock` for the life of
  the run. The kernel releases it when the process ends, however it ends (exit, crash, kill -9), so a stale
  lock never blocks a later run. A second run in the same directory is refused, naming the holder's pid.
- A fresh run never mixes with an old one: `trainer.resume=none` in a directory that holds checkpoints or
  metrics is refused (choose a new `trainer.run_dir`, or `trainer.resume=auto` to continue).
- Nothing is written through a link: the files rlkit writes at the top of the run directory are opened with
  O_NOFOLLOW as regular files with one link (`open_own`) or replaced through a new file (`write_own`); a
  symlinked one (Hydra's train.log and .hydra/ included) is refused before Hydra writes (`check_own_files`).
- A resume continues exactly or not at all: a checkpoint written by another number of processes, or by a
  run whose model, algorithm, group size or critic differ (`RESUME_KEYS`), is refused naming both values.
- A step written again never deletes the old folder: it is kept aside, with a warning (`keep_aside`).
- A checkpoint can be trusted or is not used: `checksums.json`, written last into the temporary directory
  before the rename, records the size and sha256 of every other file (the HF export `model/` included).
  `trainer.resume=auto` takes the newest checkpoint that verifies (every file present, of its size and hash,
  the trainer state readable, the weights finite) and logs why it skipped any newer one; pruning never
  deletes a checkpoint that verifies before `keep_last` newer ones verify.
- Metrics agree with the checkpoint a run continues from: each step's metrics line is written before its
  checkpoint, and on resume `metrics.jsonl` is cut back to the checkpoint's step, so every step is in it
  exactly once (the resumed run redoes, bit for bit, the steps after the checkpoint).
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import json
import logging
import os
import re
import shutil
import stat
from pathlib import Path

log = logging.getLogger(__name__)

LOCK_FILE = "rlkit.lock"
METRICS_FILE = "metrics.jsonl"
SAMPLES_FILE = "samples.jsonl"  # trainer.log_samples: generated samples, one JSON object per line
CHECKPOINTS = "checkpoints"
CHECKPOINT_RE = re.compile(r"^step_(\d+)$")
TRAINER_STATE = "trainer_state.json"  # its presence marks a checkpoint complete
CHECKSUMS = "checksums.json"  # size and sha256 of every other file of a checkpoint, written last
PENDING_FILE = "rollouts.safetensors"  # async: batches generated and not trained yet (tensors only)


# What rlkit (and Hydra, for rlkit) writes at the top of a run directory: none of them may be a symlink (a
# directory prepared by someone else could otherwise have the run overwrite any file its user can write).
OWN_FILES = (LOCK_FILE, METRICS_FILE, SAMPLES_FILE, "config.json", "curves.png", "train.log")
OWN_DIRS = (CHECKPOINTS, ".hydra")
# Set by a launcher that holds a run directory's lock for its ranks: "<pid>:<run dir>" (rlkit.train.launch).
LOCK_HOLDER_ENV = "RLKIT_RUN_DIR_LOCK_HOLDER"


class RunDirError(RuntimeError):
    """A run directory's file is not one rlkit may write (a symlink, a pipe, a hard link)."""


def open_own(path: str | Path, mode: str = "a"):
    """Open a file rlkit writes in a run directory, never through a symlink (O_NOFOLLOW), and only a regular
    file with one link: anything else is refused naming the path. `mode`: "a" (append, created), "a+"
    (read and append), "w" / "wb" (truncated)."""
    path = Path(path)
    flags = os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK
    flags |= os.O_RDWR if "+" in mode else os.O_WRONLY
    flags |= os.O_APPEND if mode.startswith("a") else 0
    try:
        fd = os.open(path, flags, 0o644)
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise RunDirError(
                f"{path} is a symlink: rlkit does not write through symlinks in a run directory (it could "
                "overwrite a file elsewhere). Remove it, or choose another trainer.run_dir."
            ) from None
        if e.errno == errno.ENXIO:  # a named pipe without a reader (O_NONBLOCK: refused, never waited on)
            raise RunDirError(
                f"{path} is not a regular file: rlkit writes only its own regular files in a run directory. "
                "Remove it, or choose another trainer.run_dir."
            ) from None
        raise
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode) or st.st_nlink != 1:
        os.close(fd)
        what = "not a regular file" if not stat.S_ISREG(st.st_mode) else f"a hard link ({st.st_nlink} names)"
        raise RunDirError(
            f"{path} is {what}: rlkit writes only its own regular files in a run directory. Remove it, or "
            "choose another trainer.run_dir."
        )
    os.set_blocking(fd, True)
    if mode.startswith("w"):
        os.ftruncate(fd, 0)
    return os.fdopen(fd, mode)


def write_own(path: str | Path, text: str) -> None:
    """Write `text` to `path` through a new temporary file renamed over it: a symlink at `path` is replaced,
    never followed, and a reader never sees half a file."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    with contextlib.suppress(FileNotFoundError):
        tmp.unlink()
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
    with os.fdopen(fd, "w") as f:
        f.write(text)
    os.replace(tmp, path)


def check_own_files(run_dir: str | Path) -> None:
    """Refuse a run directory where a file or folder rlkit writes (OWN_FILES, OWN_DIRS) is a symlink, or a
    file it writes is not a regular file, naming it."""
    run_dir = Path(run_dir)
    for name in OWN_FILES + OWN_DIRS:
        path = run_dir / name
        if path.is_symlink():
            raise RunDirError(
                f"{path} is a symlink (to {os.readlink(path)}): rlkit does not write through symlinks in a run "
                "directory (it could overwrite a file elsewhere). Remove it, or choose another trainer.run_dir."
            )
        if name in OWN_FILES and path.exists() and not path.is_file():
            raise RunDirError(f"{path} is not a regular file: remove it, or choose another trainer.run_dir.")


_HANDOVER: dict[str, RunDirLock] = {}  # locks taken by the entry for the trainer, by resolved run directory


class RunDirLock:
    """An exclusive, non-blocking flock on `<run_dir>/rlkit.lock`, holding this process's pid. A process
    may take the lock for the run it starts (`RunDirLock.for_run`: the Hydra entry, before Hydra writes), and the
    run's trainer takes that same lock over (`RunDirLock.take`, once; a second trainer in the process is
    refused as any other run). A rank whose launcher holds the lock for it (LOCK_HOLDER_ENV names the
    launcher's pid and this directory, and the lock's holder is that pid, this process's parent) holds
    nothing itself."""

    def __init__(self, run_dir: str | Path):
        self.run_dir = Path(run_dir)
        path = self.run_dir / LOCK_FILE
        self._file = open_own(path, "a+")
        try:
            fcntl.flock(self._file, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            self._file.seek(0)
            holder = self._file.read().strip() or "unknown"
            self._file.close()
            self._file = None
            if _held_by_launcher(self.run_dir, holder):
                return
            raise RuntimeError(
                f"trainer.run_dir={self.run_dir} is in use by another rlkit run (pid {holder}, lock {path}). "
                "Wait for it to end, stop it, or choose another trainer.run_dir."
            ) from None
        self._file.truncate(0)
        self._file.write(f"{os.getpid()}\n")
        self._file.flush()

    @classmethod
    def for_run(cls, run_dir: str | Path) -> RunDirLock:
        """Take the lock for the run this process starts: its trainer takes it over (`take`)."""
        key = str(Path(run_dir).resolve())
        if key not in _HANDOVER:
            _HANDOVER[key] = cls(run_dir)
        return _HANDOVER[key]

    @classmethod
    def take(cls, run_dir: str | Path) -> RunDirLock:
        """The lock `for_run` took on `run_dir` (handed over once), else a new one."""
        held = _HANDOVER.pop(str(Path(run_dir).resolve()), None)
        return held if held is not None and held._file is not None else cls(run_dir)

    @staticmethod
    def held(run_dir: str | Path) -> bool:
        """Whether this process holds a lock on `run_dir` for the run it starts (`for_run`)."""
        lock = _HANDOVER.get(str(Path(run_dir).resolve()))
        return lock is not None and lock._file is not None

    def release(self) -> None:
        if self._file is not None:
            with contextlib.suppress(OSError):
                fcntl.flock(self._file, fcntl.LOCK_UN)
            self._file.close()
            self._file = None


def _held_by_launcher(run_dir: Path, holder: str) -> bool:
    want = os.environ.get(LOCK_HOLDER_ENV, "")
    pid, _, folder = want.partition(":")
    return bool(pid) and holder == pid == str(os.getppid()) and Path(folder).resolve() == run_dir.resolve()


def unwritable(run_dir: Path) -> str | None:
    """Why the run could not write its files under `run_dir` (checkpoints included), or None. The kernel is
    asked (`access(2)`, which answers for root too: a read-only mount, an immutable folder) about
    `checkpoints/`, or the nearest folder that exists above it, where the missing ones would be made; nothing
    is written, so a run directory that is refused later (trainer.resume=none) is left untouched."""
    target = run_dir / CHECKPOINTS
    if target.exists() and not target.is_dir():
        return f"{target} is a file, not a directory"
    while not target.exists() and target != target.parent:
        target = target.parent
    if (kind := filesystem_type(target)) in PSEUDO_FILESYSTEMS:
        return f"{target} is on a {kind} file system (a kernel interface), not one that holds files"
    if not os.access(target, os.W_OK | os.X_OK):
        return f"{target} is not writable: the run could not write its checkpoints there"
    return None


def previous_run(run_dir: str | Path) -> list[str]:
    """What of an earlier run `run_dir` holds: its checkpoints and a non-empty metrics.jsonl."""
    run_dir = Path(run_dir)
    found = []
    ckpts = run_dir / "checkpoints"
    if ckpts.is_dir():
        found += sorted(f"checkpoints/{p.name}" for p in ckpts.iterdir())
    metrics = run_dir / METRICS_FILE
    if metrics.exists() and metrics.stat().st_size > 0:
        found.append(METRICS_FILE)
    return found


def check_fresh_run(run_dir: str | Path, resume: str) -> None:
    """`trainer.resume=none` must start a new run: refuse a directory holding another run's files."""
    if resume != "none":
        return
    found = previous_run(run_dir)
    if found:
        shown = ", ".join(found[:4]) + (", ..." if len(found) > 4 else "")
        raise RuntimeError(
            f"trainer.resume=none, but trainer.run_dir={run_dir} already holds a run ({shown}): a new run "
            "there would mix its metrics and checkpoints with the old ones. Choose a new trainer.run_dir, "
            "or continue the old run with trainer.resume=auto (or delete the directory)."
        )


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


def truncate_metrics(run_dir: str | Path, step: int) -> int:
    """Cut `metrics.jsonl` (and `samples.jsonl`) back to the lines of steps 0..`step` (none when `step` is 0:
    the run starts over, step-0 eval included), dropping lines a torn write left unreadable. Returns the
    number of metrics lines dropped."""
    _truncate_jsonl(Path(run_dir) / SAMPLES_FILE, step)
    return _truncate_jsonl(Path(run_dir) / METRICS_FILE, step)


def _truncate_jsonl(path: Path, step: int) -> int:
    if not path.exists():
        return 0
    keep, dropped = [], 0
    for line in path.read_text().splitlines():
        try:
            line_step = json.loads(line)["step"]
        except (ValueError, KeyError, TypeError):
            line_step = None
        if step > 0 and isinstance(line_step, int) and 0 <= line_step <= step:
            keep.append(line + "\n")
        else:
            dropped += 1
    if dropped:
        write_own(path, "".join(keep))
        log.warning(
            "%s: dropped %d lines after step %d (the resumed run redoes those steps)", path, dropped, step
        )
    return dropped


# -- checkpoints -------------------------------------------------------------------------------------


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


# Kernel interfaces that answer access(2) "writable" for root but hold no files: a report written there is
# refused by the kernel at the end of a run, or worse, reaches a kernel setting.
PSEUDO_FILESYSTEMS = frozenset({
    "sysfs", "proc", "cgroup", "cgroup2", "debugfs", "tracefs", "securityfs", "configfs", "bpf", "devpts",
    "pstore", "efivarfs", "fusectl", "mqueue", "binfmt_misc", "autofs", "rpc_pipefs", "nsfs",
})  # fmt: skip


def filesystem_type(path: Path) -> str | None:
    """The type of the file system holding the existing `path` (from /proc/self/mountinfo), or None."""
    try:
        mounts = Path("/proc/self/mountinfo").read_text().splitlines()
    except OSError:
        return None
    real, best, kind = os.path.realpath(path), "", None
    for line in mounts:
        fields = line.split()
        if " - " not in line or len(fields) < 5:
            continue
        point = fields[4].replace("\\040", " ")
        inside = real == point or real.startswith(point.rstrip("/") + "/")
        if inside and len(point) >= len(best):
            best, kind = point, line.split(" - ", 1)[1].split()[0]
    return kind


def unwritable_file(path: Path) -> str | None:
    """Why the file `path` could not be written (its folder, or the nearest one above that exists, is not
    writable, or a part of it is a file; it is there and not a regular file; it is on a kernel interface
    such as sysfs or procfs), or None; the kernel is asked (`access(2)`), nothing is written."""
    if path.exists() and not path.is_file():
        return f"{path} is not a regular file"
    target = path.parent
    while not target.exists() and target != target.parent:
        target = target.parent
    if not target.is_dir():
        return f"{target} is a file, not a directory"
    if (kind := filesystem_type(target)) in PSEUDO_FILESYSTEMS:
        return f"{target} is on a {kind} file system (a kernel interface), not one that holds files"
    if not os.access(target, os.W_OK | os.X_OK):
        return f"{target} is not writable"
    return None


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
ENOSPC_TEXTS = ("No space left on device", "os error 28")
WRITE_ERROR_TEXTS = ("basic_ios::clear", "iostream error", "unexpected pos", "PytorchStreamWriter")
FULL_BYTES, FULL_FRACTION = 64 << 20, 0.05  # at most this free (and this fraction of the device) is full


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
