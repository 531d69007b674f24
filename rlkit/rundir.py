"""The run directory: its layout and its guards (the only module that knows where files go).

    <run_dir>/rlkit.lock  metrics.jsonl  config.json  curves.png  .hydra/
    <run_dir>/checkpoints/step_<k>/{model, state, trainer_state.json, ...}   (.tmp-step_<k> while written)

The guards are checked on rank 0 before any model loads:

- One run per directory: `RunDirLock` holds an exclusive `flock` on `<run_dir>/rlkit.lock` for the life of
  the run. The kernel releases it when the process ends, however it ends (exit, crash, kill -9), so a stale
  lock never blocks a later run. A second run in the same directory is refused, naming the holder's pid.
- A fresh run never mixes with an old one: `trainer.resume=none` in a directory that holds checkpoints or
  metrics is refused (choose a new `trainer.run_dir`, or `trainer.resume=auto` to continue).
- A resume continues exactly or not at all: a checkpoint written by another number of processes is refused.
- Metrics agree with the checkpoint a run continues from: each step's metrics line is written before its
  checkpoint, and on resume `metrics.jsonl` is cut back to the checkpoint's step, so every step is in it
  exactly once (the resumed run redoes, bit for bit, the steps after the checkpoint).
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import os
import re
import shutil
from pathlib import Path

log = logging.getLogger(__name__)

LOCK_FILE = "rlkit.lock"
METRICS_FILE = "metrics.jsonl"
CHECKPOINTS = "checkpoints"
CHECKPOINT_RE = re.compile(r"^step_(\d+)$")
TRAINER_STATE = "trainer_state.json"  # written last into a checkpoint: its presence marks it complete
PENDING_FILE = "rollouts.safetensors"  # async: batches generated and not trained yet (tensors only)


class RunDirLock:
    """An exclusive, non-blocking flock on `<run_dir>/rlkit.lock`, holding this process's pid."""

    def __init__(self, run_dir: str | Path):
        self.run_dir = Path(run_dir)
        path = self.run_dir / LOCK_FILE
        self._file = open(path, "a+")
        try:
            fcntl.flock(self._file, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            self._file.seek(0)
            holder = self._file.read().strip() or "unknown"
            self._file.close()
            raise RuntimeError(
                f"trainer.run_dir={self.run_dir} is in use by another rlkit run (pid {holder}, lock {path}). "
                "Wait for it to end, stop it, or choose another trainer.run_dir."
            ) from None
        self._file.truncate(0)
        self._file.write(f"{os.getpid()}\n")
        self._file.flush()

    def release(self) -> None:
        if self._file is not None:
            with contextlib.suppress(OSError):
                fcntl.flock(self._file, fcntl.LOCK_UN)
            self._file.close()
            self._file = None


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


def truncate_metrics(run_dir: str | Path, step: int) -> int:
    """Cut `metrics.jsonl` back to the lines of steps 0..`step` (none when `step` is 0: the run starts over,
    step-0 eval included), dropping lines a torn write left unreadable. Returns the number of lines dropped."""
    path = Path(run_dir) / METRICS_FILE
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
        tmp = path.with_name(f".{METRICS_FILE}.tmp")
        tmp.write_text("".join(keep))
        os.replace(tmp, path)
        log.warning(
            "%s: dropped %d lines after step %d (the resumed run redoes those steps)", path, dropped, step
        )
    return dropped


# -- checkpoints -------------------------------------------------------------------------------------


def latest_checkpoint(run_dir: str | Path) -> Path | None:
    """The complete checkpoint with the highest step in `run_dir/checkpoints` (temp dirs are ignored)."""
    root = Path(run_dir) / CHECKPOINTS
    if not root.is_dir():
        return None
    done = [
        (int(m.group(1)), p)
        for p in root.iterdir()
        if (m := CHECKPOINT_RE.match(p.name)) and (p / TRAINER_STATE).exists()
    ]
    return max(done)[1] if done else None


def resume_path(run_dir: str | Path, resume: str) -> Path | None:
    """The checkpoint `trainer.resume` names: none, the latest complete one (auto), or a directory."""
    if resume == "none":
        return None
    if resume == "auto":
        return latest_checkpoint(run_dir)
    path = Path(resume)
    if not (path / TRAINER_STATE).exists():
        raise FileNotFoundError(
            f"trainer.resume={resume!r} is not a complete checkpoint (no {TRAINER_STATE})"
        )
    return path


def checkpoint_dirs(run_dir: str | Path, step: int) -> tuple[Path, Path]:
    """(temporary, final) directory of the checkpoint of `step`: written into the first, renamed to the second."""
    root = Path(run_dir) / CHECKPOINTS
    return root / f".tmp-step_{step}", root / f"step_{step}"


def commit_checkpoint(tmp: Path, final: Path, state: dict) -> None:
    """Write the trainer state last, then rename the complete checkpoint into place."""
    (tmp / TRAINER_STATE).write_text(json.dumps(state))
    if final.exists():
        shutil.rmtree(final)
    tmp.rename(final)


def prune_checkpoints(run_dir: str | Path, keep: int) -> None:
    """Delete all but the `keep` most recent checkpoints (0 keeps all)."""
    if keep <= 0:
        return
    root = Path(run_dir) / CHECKPOINTS
    done = sorted((int(m.group(1)), p) for p in root.iterdir() if (m := CHECKPOINT_RE.match(p.name)))
    for _, path in done[:-keep]:
        shutil.rmtree(path, ignore_errors=True)
