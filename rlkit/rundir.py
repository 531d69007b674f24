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
- Checkpoints (written atomically, verified, resumed exactly) are rlkit/checkpoints.py's.
- Metrics agree with the checkpoint a run continues from: each step's metrics line is written before its
  checkpoint, and on resume `metrics.jsonl` is cut back to the checkpoint's step, so every step is in it
  exactly once (the resumed run redoes, bit for bit, the steps after the checkpoint).
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import logging
import os
import re
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
