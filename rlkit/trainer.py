"""The training loop: produce -> learn -> push -> report, each a call; checkpoint, resume, signals.

    1 generate     engine.generate (whole groups per rank)              } `self.rollouts.produce`: in this process
    2 reward       reward functions in worker processes (errors /        } (rlkit/rollout/local.py, trainer.mode=sync)
                   timeouts count, never crash), environments, refill    } or from rollout workers (rollout/remote/)
    3-6 learn      log-probs, advantages, correction, update             `self.learn` (rlkit/learn.py: its
                                                                         table gives both orders of the phases)
    7 weight push  the learner's weights to the engine, verified         `self.sync.push` (rlkit/sync.py)
      report       statistics, timings, throughput and MFU               `self.report` (rlkit/metrics.py, flops.py)
    8 eval         every trainer.eval_every steps and at the end (never masked)
    9 checkpoint   every trainer.save_every steps, at the end, and on SIGTERM / SIGINT / SIGHUP

Every rank runs the same code on its own prompts; per-sample statistics are gathered across ranks in one
collective and token statistics merged by token counts, so the logged numbers describe the global batch.
`check_config` checks the keys the loop owns; rlkit.train's preflight calls it with every other
component's before any process starts or any model loads.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
import signal
import time
from collections.abc import Callable
from pathlib import Path

import torch

from rlkit import checkpoints, gcpolicy, rundir
from rlkit.collectives import CollectiveWatch, all_reduce, broadcast_object
from rlkit.config.rules import choice, nonempty
from rlkit.config.schema import ConfigError, RLConfig, to_dict
from rlkit.flops import GEN_COUNTERS, MEASURED, DevicePeak, cached_cpu_peak, device_peak, step_rates
from rlkit.learn import Learn
from rlkit.learner import Learner
from rlkit.learner.strategy import make_accelerator
from rlkit.logging import MetricsLogger
from rlkit.metrics import run_summary, to_host, without_absent_tasks
from rlkit.models import load_tokenizer, model_shape
from rlkit.plots import plot_finished_run
from rlkit.rollout.local import LocalRollouts
from rlkit.rollout.protocol import Rollouts
from rlkit.rollout.remote.client import AsyncRollouts
from rlkit.rollout.samples import eval_rows, train_rows
from rlkit.sync import WeightSync
from rlkit.timing import Timers, peak_memory_gb
from rlkit.vision import copy_processor
from rlkit.weights import WeightSyncError

log = logging.getLogger(__name__)

__all__ = ["Trainer", "WeightSyncError", "check_config", "guard_run_dir", "run"]

MODES = ("sync", "async")  # trainer.mode


def check_config(cfg: RLConfig) -> None:
    """The keys the loop owns: trainer.mode, run_dir, resume (raises ConfigError); the async keys are checked
    by rlkit/rollout/remote/client.py."""
    t = cfg.trainer
    choice("trainer.mode", t.mode, MODES)
    nonempty("trainer.run_dir", t.run_dir)
    if Path(t.run_dir).expanduser().is_file():
        raise ConfigError(f"trainer.run_dir={t.run_dir!r} is a file, not a directory")
    if (why := rundir.unwritable(Path(t.run_dir).expanduser())) is not None:
        raise ConfigError(f"trainer.run_dir={t.run_dir!r}: {why}")
    if t.resume not in ("auto", "none") and not Path(t.resume).expanduser().is_dir():
        raise ConfigError(
            f"trainer.resume={t.resume!r} is not 'auto', 'none' or an existing checkpoint directory"
        )


STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)
"""Finish the step, write a checkpoint, exit 0 (SIGHUP: a closed terminal). rlkit.train's launcher passes the
same ones (its own STOP_SIGNALS) on to its ranks."""


def write_checkpoint(
    run_dir: Path, step: int, learner, accelerator, tokenizer, *, is_main: bool, world: int, keep_last: int,
    state: Callable[[Path], dict],
) -> Path:  # fmt: skip
    """Write `checkpoints/step_<step>` through a temporary directory renamed into place when complete (with
    `checksums.json`, rlkit.rundir). Never from non-finite weights; on any failure (a full disk: "no space left")
    the temporary directory is removed and the previous checkpoint is left as it was. `state(tmp)`, called on every
    rank, gives the run's own entries of trainer_state.json beside the step and the world size. Every rank calls
    it; `python -m rlkit.sft` writes its checkpoints with it too."""
    tmp, final = checkpoints.checkpoint_dirs(run_dir, step)
    learner.refuse_nonfinite_checkpoint(f"step {step}: checkpoint {final}", run_dir)
    no_room = checkpoints.no_room_for(final) if is_main else None
    if (no_room := broadcast_object(no_room, world)) is not None:  # every rank stops alike
        raise checkpoints.CheckpointError(no_room)
    with checkpoints.writing_checkpoint(tmp, main=is_main):
        if is_main:
            if tmp.is_symlink():
                tmp.unlink()
            shutil.rmtree(tmp, ignore_errors=True)  # left over by an interrupted save
            tmp.mkdir(parents=True)
        accelerator.wait_for_everyone()
        learner.save_checkpoint(tmp)
        extra = state(tmp)
        if is_main:
            tokenizer.save_pretrained(tmp / "model")
            if getattr(learner, "vision", False):  # a run with images: the checkpoint keeps its processor
                copy_processor(learner.cfg.model.path, tmp / "model")
            checkpoints.commit_checkpoint(tmp, final, {"step": step, **extra, "world_size": world})
            checkpoints.prune_checkpoints(run_dir, keep_last)
        accelerator.wait_for_everyone()
    log.info("checkpoint written: %s", final)
    return final


def guard_run_dir(run_dir: Path, resume: str, world: int, is_main: bool, *, record: dict | None = None):
    """Lock `run_dir` for this run, check what it holds and choose the checkpoint to resume from (the newest
    that verifies: rlkit.rundir), on rank 0 before any model loads; every rank raises rank 0's error. Returns
    (the lock on rank 0 else None, the checkpoint or None). `record`: what the run's checkpoints record of its
    config (`Trainer.resume_record`), which a resume must match. `python -m rlkit.sft` guards its run dir alike."""
    lock = error = resume_from = None
    if is_main:
        try:
            lock = rundir.RunDirLock.take(run_dir)
            rundir.check_own_files(run_dir)
            rundir.check_fresh_run(run_dir, resume)
            resume_from = checkpoints.resume_path(run_dir, resume)
            if resume_from is not None:
                checkpoints.check_world_size(resume_from, world)
                if record is not None:
                    checkpoints.check_resume_keys(resume_from, record)
            step = checkpoints.checkpoint_state(resume_from)["step"] if resume_from else 0
            rundir.truncate_metrics(run_dir, step)
        except Exception as e:
            if lock is not None:
                lock.release()
            error = e
    error, resume_from = broadcast_object((error, resume_from), world)
    if error is not None:
        raise error
    return lock, resume_from


class Trainer:
    """Builds everything from the config and runs `train()`. One instance per rank."""

    def __init__(self, cfg: RLConfig):

        self.cfg = cfg
        t = cfg.trainer
        # The accelerator initialises torch.distributed when launched with several processes.
        self.accelerator = make_accelerator(cfg)
        self.rank = self.accelerator.process_index
        self.world = self.accelerator.num_processes
        self.is_main = self.rank == 0

        self._watch = CollectiveWatch(self.world, t.collective_timeout_s)  # names a stopped rank
        self.run_dir = Path(broadcast_object(str(Path(t.run_dir).resolve()), self.world))
        if self.is_main:
            self.run_dir.mkdir(parents=True, exist_ok=True)
        self._run_lock, resume_from = self._guard_run_dir()

        self.tokenizer = load_tokenizer(cfg.model.path)
        self.learner = Learner(cfg, self.accelerator)
        self.learn = Learn(cfg, self.learner, world=self.world)  # phases 3-6 (rlkit/learn.py)
        if self.rank == 0:
            reused = self.learn.reuse_forward
            log.info(
                "log-probs: %s",
                "from the update's forward" if reused else f"a separate pass ({self.learn.why_not_reused})",
            )
        self.device = self.learner.device
        # The peak FLOP/s of one device (rank 0 measures a CPU once; every rank divides by the same figure).
        peak = device_peak(self.device, self.learner.compute_dtype, t.peak_tflops) if self.is_main else None
        flops, source = broadcast_object(peak, self.world)
        self.peak = DevicePeak(flops, source, self._remeasure_peak if source.startswith(MEASURED) else None)
        if self.is_main:
            log.info("peak of one device for MFU: %.1f TFLOP/s (%s)", flops / 1e12, source)
        self.rollouts = self._make_rollouts()  # phases 1-2
        self.sync = WeightSync(cfg, self.rollouts, compute_dtype=self.learner.compute_dtype)  # phase 7

        self.global_step = 0
        self.wandb_id = None
        self._stop_signal: int | None = None
        self._samples: list[dict] = []  # trainer.log_samples rows of the current step
        if resume_from is not None:
            self._load_checkpoint(resume_from)

        self.logger = None
        if self.is_main:
            lc = cfg.logger
            self.logger = MetricsLogger(
                lc.backend, self.run_dir, to_dict(cfg), project=lc.project, entity=lc.entity, name=lc.name,
                tags=lc.tags, resume_id=self.wandb_id,
            )  # fmt: skip
            self.wandb_id = self.logger.run_id
            rundir.write_own(self.run_dir / "config.json", json.dumps(to_dict(cfg), indent=2))

    def resume_record(self) -> dict:
        """What a checkpoint records of this run's config, for a resume to compare (checkpoints.RESUME_KEYS)."""
        return checkpoints.resume_record(to_dict(self.cfg), model_shape(self.cfg.model.path))

    def _guard_run_dir(self):
        return guard_run_dir(
            self.run_dir, self.cfg.trainer.resume, self.world, self.is_main, record=self.resume_record()
        )

    def _make_rollouts(self) -> Rollouts:
        """The rollout half: colocated with this rank (sync), or in rollout worker processes (async)."""
        cfg = self.cfg
        if cfg.trainer.mode == "sync":
            return LocalRollouts(
                cfg, rank=self.rank, world=self.world, device=self.device, tokenizer=self.tokenizer,
                reward_dtype=self.learner.compute_dtype,
            )  # fmt: skip
        return AsyncRollouts(cfg, rank=self.rank, world=self.world, device=self.device)

    # -- the step ------------------------------------------------------------------------------

    def train_step(self) -> dict[str, float]:
        """One step on this rank's share of the global batch; returns the global metrics (all ranks)."""
        timers = Timers()
        step_start = time.perf_counter()
        # 1-2. generate and reward (+ environment turns, overlong shaping, dynamic sampling).
        produced = self.rollouts.produce(self.global_step, timers)
        if self.cfg.trainer.log_samples and self.is_main:  # logged with the step's metrics
            self._samples = train_rows(
                produced, self.tokenizer, self.cfg.trainer.log_samples, self.global_step + 1
            )
        # 3-6. log-probs, advantages, correction, update.
        stats = self.learn(produced, self.global_step, timers)
        # 7. the weight push (an eval of the new version, when due, is requested with it: rlkit/sync.py).
        with timers("weight_push"):
            pushed = self.sync.push(self.learner.export())
        return self.report(stats, pushed, timers, time.perf_counter() - step_start)

    def report(
        self, stats: dict, pushed: dict[str, float], timers: Timers, elapsed: float
    ) -> dict[str, float]:
        """The step's logged metrics: its statistics on the host, the phases' timings, throughput and MFU
        (rlkit/flops.py), the push's."""
        metrics = without_absent_tasks(to_host(stats))
        metrics.update(timers.seconds)
        metrics.update(
            step_rates(metrics, elapsed, shape=self.learner.shape, world=self.world, peak=self.peak)
        )
        for key in GEN_COUNTERS:  # read by the rates only
            del metrics[key]
        metrics.update(pushed)
        metrics["perf/peak_memory_gb"] = peak_memory_gb()
        if self.cfg.trainer.mode == "async":  # the drift statistics of this batch's staleness
            staleness = int(metrics["staleness/max"])
            for key in ("mismatch/kl", "rollout_is/mean", "rollout_is/eff_sample_size"):
                if key in metrics:
                    metrics[f"{key}/staleness_{staleness}"] = metrics[key]
        return metrics

    def _remeasure_peak(self, achieved: float) -> float:
        """The CPU peak measured again on rank 0 (not the cached figure), stored with the rate a phase achieved
        if higher, so the next runs start from it; every rank gets the same figure."""
        fresh = (
            cached_cpu_peak(self.learner.compute_dtype, fresh=True, at_least=achieved)[0]
            if self.is_main
            else None
        )
        return broadcast_object(fresh, self.world)

    # -- eval ----------------------------------------------------------------------------------

    def evaluate(self) -> dict[str, float]:
        """pass@k, maj@k, reward of the current weights on the held-out split (rlkit/rollout/evaluation.py)."""
        metrics = self.rollouts.evaluate(self.global_step)
        if self.cfg.trainer.log_samples and self.logger is not None:  # (async: the workers keep theirs)
            rows = eval_rows(self.rollouts.last_eval, self.cfg.trainer.log_samples, self.global_step)
            self.logger.log_samples(rows, self.global_step, "eval")
        return metrics

    # -- checkpoints ---------------------------------------------------------------------------

    def save_checkpoint(self) -> Path:
        """`checkpoints/step_<k>` (`write_checkpoint`), with the data position (async: the pending batches),
        the W&B run and what a resume must match."""
        return write_checkpoint(
            self.run_dir, self.global_step, self.learner, self.accelerator, self.tokenizer, is_main=self.is_main,
            world=self.world, keep_last=self.cfg.trainer.keep_last, state=self._checkpoint_state,
        )  # fmt: skip

    def _checkpoint_state(self, tmp: Path) -> dict:
        state = {
            **self.rollouts.checkpoint(tmp),
            "wandb_id": self.wandb_id,
        }  # every rank (async: its batches)
        if self.is_main:
            state["resume_keys"] = self.resume_record()
        return state

    def _load_checkpoint(self, path: Path) -> None:
        state = checkpoints.checkpoint_state(path)
        self.learner.load_checkpoint(path)
        self.global_step = state["step"]
        self.rollouts.load_checkpoint(path, state)
        self.wandb_id = state.get("wandb_id")
        if self.is_main:
            print(f"Resumed from {path} at step {self.global_step}", flush=True)

    # -- the loop ------------------------------------------------------------------------------

    def _on_signal(self, signum, frame):
        if self._stop_signal is None:  # (a rank may get one from its launcher and one from its terminal)
            log.warning("received signal %d: finishing this step, writing a checkpoint and exiting", signum)
        self._stop_signal = signum

    def _should_stop(self) -> bool:
        flag = torch.tensor([1.0 if self._stop_signal is not None else 0.0], device=self.device)
        return bool(all_reduce(flag, self.world, self.device)[0] > 0)

    def train(self) -> list[dict[str, float]]:
        """Run from the current step to trainer.steps; returns the logged metrics of each step (the
        step-0 baseline eval of `trainer.eval_at_start` is logged as step 0, not returned)."""
        t = self.cfg.trainer
        history = []
        previous = {}
        for sig in STOP_SIGNALS:
            with contextlib.suppress(ValueError):  # not the main thread
                previous[sig] = signal.signal(sig, self._on_signal)
        bar, redirect = None, contextlib.nullcontext()
        if self.is_main and t.progress_bar:
            from tqdm import tqdm
            from tqdm.contrib.logging import logging_redirect_tqdm

            bar = tqdm(total=t.steps, initial=self.global_step, desc="train", dynamic_ncols=True)
            # log lines print above the bar instead of breaking it
            redirect = logging_redirect_tqdm([logging.getLogger(), logging.getLogger("vllm")])
        try:
            with redirect:
                self._run(bar, history)
        finally:
            if bar is not None:
                bar.close()
            for sig, handler in previous.items():
                signal.signal(sig, handler)
        if self.is_main:  # curves for a user without W&B: <run_dir>/curves.png (scripts/plot_run.py RUN_DIR)
            for line in run_summary(history):
                log.info("%s", line)
            if t.curves:
                plot_finished_run(self.run_dir)
        return history

    def _baseline(self) -> None:
        """The engine gets the learner's weights (a resumed run's; async: the workers start), then the
        step-0 evaluation the run is judged against."""
        t = self.cfg.trainer
        baseline = t.eval_at_start and self.global_step == 0
        self.sync.start(self.learner.export(), self.global_step, evaluate=baseline)
        if baseline:
            timers = Timers()
            with timers("eval"):
                metrics = self.evaluate()
            metrics.update(timers.seconds)
            if self.logger is not None and "eval/pass@1" in metrics:
                self.logger.log(metrics, step=0)

    def _run(self, bar, history: list) -> None:
        t = self.cfg.trainer
        checkpoint_timing = {}
        self._baseline()
        while self.global_step < t.steps:
            metrics = self.train_step()
            self.sync.check_batch(metrics, self.global_step)
            self.global_step += 1
            timers = Timers()
            if self.sync.eval_due(self.global_step):
                with timers("eval"):
                    metrics.update(self.evaluate())
            stop = self._should_stop()
            metrics.update(timers.seconds)
            metrics.update(checkpoint_timing)  # the checkpoint written after the previous step
            checkpoint_timing = {}
            history.append(metrics)
            # The step's line goes out before its checkpoint: a crash between the two leaves a line
            # that the resumed run cuts off and redoes (rlkit.rundir.truncate_metrics), never a gap.
            if self.logger is not None:
                self.logger.log(metrics, step=self.global_step)
                self.logger.log_samples(self._samples, self.global_step, "train")
            self._samples = []
            # Before the checkpoint: the last one written stays the last good one.
            self.learner.stop_after_nonfinite_steps(self.global_step, metrics)
            if bar is not None:
                bar.set_postfix(reward=f"{metrics['reward/mean']:.3f}", acc=f"{metrics['accuracy']:.3f}")
                bar.update(1)
            if (t.save_every and self.global_step % t.save_every == 0) or self.global_step == t.steps or stop:
                checkpoint_timers = Timers()
                with checkpoint_timers("checkpoint"):
                    self.save_checkpoint()
                checkpoint_timing = checkpoint_timers.seconds
            if stop:
                log.warning(
                    "stopped by signal %s at step %d (checkpoint written)",
                    self._stop_signal,
                    self.global_step,
                )
                break

    def close(self) -> None:
        self.rollouts.close()
        if self.logger is not None:
            self.logger.close()
            self.logger = None
        if self._run_lock is not None:
            self._run_lock.release()
            self._run_lock = None


def run(cfg: RLConfig) -> list[dict[str, float]]:
    """Build a Trainer for this rank, train, clean up. Returns the per-step metrics."""
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    with gcpolicy.setup_phase():  # models and engines built without automatic collections (gcpolicy.py)
        trainer = Trainer(cfg)
    try:
        return trainer.train()
    except Exception as e:
        explained = trainer._watch.explain(e)  # a collective timed out: which rank stopped?
        if explained is not None:
            raise explained from e
        raise
    finally:
        trainer.close()
