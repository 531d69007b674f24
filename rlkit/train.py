"""`python -m rlkit.train +recipe=NAME [key=value ...]`: the command-line entry point.

Composes the Hydra config (configs/ + recipes/ + overrides), checks it before any model loads (`preflight`:
the schema's rules, then every component's `check_config`), and runs the trainer: in this process, or in one process per GPU that it starts itself (torch's elastic
launcher), or in the processes `torchrun` / `accelerate launch` started (RANK / WORLD_SIZE set).

    python -m rlkit.train +recipe=quickstart                      # offline, CPU
    python -m rlkit.train +recipe=grpo_gsm8k trainer.steps=50 rollout.group_size=16
    torchrun --nproc-per-node 8 -m rlkit.train +recipe=grpo_gsm8k
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import signal
import sys
import time
import traceback
import uuid
from pathlib import Path

import hydra
from hydra.core.hydra_config import HydraConfig
from hydra.experimental.callback import Callback
from hydra.types import RunMode
from omegaconf import DictConfig, OmegaConf, read_write

from rlkit import envs, gcpolicy, rewards, rundir
from rlkit import logging as sinks
from rlkit.config.schema import CONFIG_DIR, RLConfig, register_configs, to_dict
from rlkit.data import loading

# Nothing heavier than Hydra at import: every process that multiprocessing spawns from `python -m rlkit.train`
# (reward, rollout and environment workers) imports this module first, as its `__mp_main__`. The components
# (torch, transformers) are imported by the functions that use them.

__all__ = ["compose", "load_config", "main", "preflight"]

log = logging.getLogger(__name__)

# Recipes (recipes/*.yaml) become the Hydra group `recipe`, so `+recipe=NAME` works from any folder.
register_configs()

LAUNCHER_POLL_S = 0.5
"""How often a rank started by `launch` checks that its launcher is alive (`follow_launcher`)."""

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)
"""The signals that stop a run gracefully (finish the step, write a checkpoint, exit 0: rlkit/trainer.py); the
launcher passes them on to its ranks (`launch`)."""


def preflight(cfg: RLConfig) -> None:
    """Every component checks the keys it owns, before any process starts or any model loads."""
    from rlkit import learner, trainer
    from rlkit.config.rules import local_path_exists, model_folder_ok
    from rlkit.data import sft
    from rlkit.rollout import engines, evaluation, producer
    from rlkit.rollout.remote import client

    local_path_exists("model.path", cfg.model.path)
    model_folder_ok("model.path", cfg.model.path)  # before any check loads its tokenizer or config
    for check in (
        loading.check_config, rewards.check_config, learner.check_config, engines.check_config,
        producer.check_config, trainer.check_config, client.check_config, envs.check_config, producer.check_inputs,
        evaluation.check_config, sft.check_config, sinks.check_config,
        loading.check_data,  # loads the data (a data error stops the run here)
    ):  # fmt: skip
        check(cfg)


def load_config(cfg, *, world_size: int = 1) -> RLConfig:
    """Composed Hydra config -> checked `RLConfig`: the schema's rules, then every component's `check_config`."""
    from rlkit import learner
    from rlkit.config.rules import parse

    config = parse(cfg, world_size=world_size)
    learner.strategy.resolve_dtypes(config)  # model.dtype=auto -> the machine's fast dtype, before any check
    preflight(config)
    return config


def compose(overrides: list[str] | None = None) -> DictConfig:
    """The composed (unvalidated) config for `overrides`, as the command line would build it."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir

    with initialize_config_dir(str(CONFIG_DIR), version_base=None):
        return hydra_compose("config", overrides=list(overrides or []))


def _launched_world_size() -> int | None:
    """WORLD_SIZE when an external launcher (torchrun, accelerate launch) started this process."""
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        return int(os.environ["WORLD_SIZE"])
    return None


def default_num_processes(cfg: DictConfig) -> int:
    """trainer.num_processes, else one learner process per GPU it may use: every visible GPU (async: but the
    last trainer.rollout_gpus, which the rollout workers take, rlkit/rollout/remote/), or fewer where the
    batch does not split over that many ranks (the largest count it splits over; the idle GPUs are logged)."""
    t, r = cfg.trainer, cfg.rollout
    if t.num_processes is not None:
        return int(t.num_processes)
    import torch

    from rlkit.config.rules import fitting_worlds, working_values

    if t.device == "cpu" or not torch.cuda.is_available():
        return 1
    gpus = torch.cuda.device_count()
    reserved = t.rollout_gpus if t.mode == "async" else 0
    usable = max(1, gpus - reserved)
    fits = fitting_worlds(t.train_batch_size, r.group_size, cfg.algo.mini_batches, usable)
    if not fits or fits[0] == usable:
        return usable  # nothing fits: the rules name the values that would (load_config)
    log.warning(
        "%d GPUs%s: trainer.train_batch_size=%d splits over %d learner ranks, not %d (rollout.group_size=%d, "
        "algo.mini_batches=%d), so %d GPU(s) stay idle; %s",
        gpus, f", {reserved} for the rollout workers" if reserved else "", t.train_batch_size, fits[0], usable,
        r.group_size, cfg.algo.mini_batches, usable - fits[0],
        working_values(t.train_batch_size, r.group_size, cfg.algo.mini_batches, usable),
    )  # fmt: skip
    return fits[0]


def _worker(config: dict) -> None:
    """The trainer, in a process `launch` started or one of an external launcher (module level: pickled)."""
    with gcpolicy.setup_phase():  # the imports and checks without automatic garbage collection (gcpolicy.py)
        import torch

        from rlkit.trainer import run

        if not torch.cuda.is_available() and "OMP_NUM_THREADS" not in os.environ:
            # Processes share the cores; without this each one starts a thread per core.
            torch.set_num_threads(
                max(1, (os.cpu_count() or 1) // int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
            )
        checked = load_config(config, world_size=int(os.environ.get("WORLD_SIZE", "1")))
    run(checked)


def _rank(worker, config: dict, launcher: int, logs: str) -> None:
    """Entry of each process started by `launch` (module level so it can be pickled): `worker(config)` in a rank
    that ends with its launcher, pid `launcher` (`follow_launcher`); `logs`: the launcher's temp folder."""
    follow_launcher(launcher, logs)
    try:
        worker(config)
    except BaseException:
        if os.getppid() != launcher:
            traceback.print_exc()
            _leave(1, logs)
        raise
    if os.getppid() != launcher:
        _leave(0, logs)


def follow_launcher(launcher: int, logs: str | None) -> None:
    """In a rank started by `launch`: when the launcher (pid `launcher`) is gone (SIGKILLed), this rank stops.

    A thread checks every `LAUNCHER_POLL_S` that the rank's parent is still the launcher (so a launcher that
    died before this rank got here is seen too); when it is not, it removes the launcher's temp folder `logs`
    (the launcher's own clean-up never ran) and sends this rank SIGTERM: in training that is the trainer's
    "finish this step, write a checkpoint, exit" (rlkit/trainer.py), before it the default (the rank ends).
    torch's spawn wrapper sets the parent-death signal to SIGINT; it is cleared, so one signal stops a rank.
    The ranks of a run get it alike, so the stop flag's all-reduce sees every rank stopping at the same step."""
    import ctypes
    import threading

    with contextlib.suppress(OSError, AttributeError):  # not Linux: the thread below still watches
        ctypes.CDLL(None, use_errno=True).prctl(1, 0)  # PR_SET_PDEATHSIG: none

    def watch() -> None:
        while os.getppid() == launcher:
            time.sleep(LAUNCHER_POLL_S)
        if logs is not None:
            shutil.rmtree(logs, ignore_errors=True)
        log.warning("the launcher (pid %d) is gone: stopping this rank", launcher)
        os.kill(os.getpid(), signal.SIGTERM)

    threading.Thread(target=watch, daemon=True, name="rlkit-launcher-watch").start()


def _leave(status: int, logs: str | None) -> None:
    """End a rank whose launcher is gone: torch's wrapper would wait forever for the launcher to read the
    rank's result. Streams flushed, the launcher's temp folder removed."""
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    if logs is not None:
        shutil.rmtree(logs, ignore_errors=True)
    os._exit(status)


def launch(cfg: RLConfig, num_processes: int, worker=None) -> None:
    """Start `num_processes` local processes (one per GPU, or gloo on CPU) running the trainer (or `worker`, a
    module-level function of the config dict: `python -m rlkit.sft` runs its own).

    torch's launcher gives each rank a folder for its error file; without a log folder named it makes one under
    the temp folder (`torchelastic_*`) and never removes it. Here that folder is temporary, removed when the run
    ends however it ends (a failed rank's error is already read into the raised error by then; a SIGKILLed
    launcher's by its ranks, `follow_launcher`).

    Signals: SIGTERM, SIGINT or SIGHUP to the launcher is passed on to the ranks, which finish their step, write
    a checkpoint and return, so the run ends as a finished one does (status 0). torch's launcher would instead
    send the signal and stop reading the ranks' results, and a rank that returned waited for that read until
    the launcher's shutdown timeout SIGKILLed it (trainer.collective_timeout_s, 600 s by default). A second
    signal is torch's: it sends the signal again and SIGKILLs what is left after the shutdown timeout."""
    import tempfile

    from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    with tempfile.TemporaryDirectory(prefix="rlkit-launch-", ignore_cleanup_errors=True) as logs:
        config = LaunchConfig(
            min_nodes=1,
            max_nodes=1,
            nproc_per_node=num_processes,
            run_id=f"rlkit-{uuid.uuid4().hex[:8]}",
            rdzv_backend="c10d",
            # Port 0: the rendezvous store binds a port the OS gives it, as torchrun --standalone does. A port
            # chosen first and bound later could be taken meanwhile, and torch's c10d backend then joins
            # whatever store listens there as a client.
            rdzv_endpoint="127.0.0.1:0",
            max_restarts=0,
            monitor_interval=1,
            # When a rank fails, the others get SIGTERM and this long to exit before SIGKILL (a stopped rank
            # never exits by itself).
            shutdown_timeout=max(1, int(cfg.trainer.collective_timeout_s)),
            logs_specs=DefaultLogsSpecs(log_dir=logs),
            signals_to_handle="SIGQUIT",  # torch's handler; the stop signals are `_passing_stop_signals`'
        )
        # The resolved config travels to the children, so they all agree on run_dir and every other value.
        # The run directory's lock, taken by this process before Hydra wrote there, is held here for them.
        if rundir.RunDirLock.held(cfg.trainer.run_dir):
            os.environ[rundir.LOCK_HOLDER_ENV] = f"{os.getpid()}:{Path(cfg.trainer.run_dir).resolve()}"
        with _passing_stop_signals():
            elastic_launch(config, _rank)(worker or _worker, to_dict(cfg), os.getpid(), logs)


@contextlib.contextmanager
def _passing_stop_signals():
    """While torch's launcher runs: the first of `STOP_SIGNALS` goes to the ranks (the launcher keeps reading
    their results), a later one is torch's (its SignalException: signal the ranks, SIGKILL after the shutdown
    timeout). torch installs its own handlers for LaunchConfig.signals_to_handle when it starts the ranks; `launch`
    narrows that to SIGQUIT, so these handlers stay."""
    import multiprocessing

    from torch.distributed.elastic.multiprocessing.api import SignalException

    received: list[int] = []

    def pass_on(signum, frame) -> None:
        if received:
            raise SignalException(
                f"Process {os.getpid()} got signal: {signum}", sigval=signal.Signals(signum)
            )
        received.append(signum)
        log.warning(
            "launcher: signal %d passed on to the ranks (they finish their step, checkpoint, exit)", signum
        )
        for child in multiprocessing.active_children():  # the ranks (torch starts them with multiprocessing)
            with contextlib.suppress(OSError, TypeError):
                os.kill(child.pid, signum)

    before = {}
    for signum in STOP_SIGNALS:
        with contextlib.suppress(ValueError):  # not the main thread: torch's handling, as before
            before[signum] = signal.signal(signum, pass_on)
    try:
        yield
    finally:
        for signum, handler in before.items():
            signal.signal(signum, handler)


def main_from_config(cfg: DictConfig) -> None:
    from rlkit.trainer import run

    launched = _launched_world_size()
    if launched is not None:
        _worker(cfg)
        return
    with gcpolicy.setup_phase():  # the imports and checks without automatic garbage collection (gcpolicy.py)
        n = default_num_processes(cfg)
        config = load_config(cfg, world_size=n)  # fail before any process starts or model loads
    if n == 1:
        run(config)
    else:
        launch(config, n)


def one_run_dir(cfg: DictConfig) -> DictConfig:
    """Resolve `cfg` once, with the values Hydra used for its output dir, and make that dir the run's.

    Hydra resolves `hydra.run.dir` (`${trainer.run_dir}` = `runs/${logger.name}`) before the job starts;
    its `${now:...}` cache travels with this copy of the config but not through the merge into the schema,
    so resolving later reads the clock again (`.hydra/` and the log in one directory, the run a second
    later in another). Resolving here reuses the cached values; a `hydra.run.dir` set on the command line
    becomes the run dir too.
    """
    with read_write(cfg):
        OmegaConf.resolve(cfg)
        hydra_cfg = HydraConfig.get()
        output_dir = Path(hydra_cfg.runtime.output_dir)
        if hydra_cfg.mode == RunMode.RUN and Path(cfg.trainer.run_dir).resolve() != output_dir.resolve():
            cfg.trainer.run_dir = str(output_dir)
    return cfg


class RunDirGuard(Callback):
    """Hydra callback (configs/config.yaml, `hydra.callbacks.run_dir_guard`): before Hydra writes into the
    run directory (`.hydra/`, `train.log`), refuse one where a file rlkit writes is a symlink and take the
    run's lock (rlkit.rundir), so a second run in a directory a live run holds is refused having written
    nothing there. The trainer reuses the lock (`RunDirLock.take`); a launcher holds it for its ranks. Under
    an external launcher (torchrun) rank 0 takes it. A directory that cannot be made or written is left to
    Hydra's and the preflight's errors."""

    def on_run_start(self, config: DictConfig, **kwargs) -> None:
        if os.environ.get("RANK", "0") != "0" or OmegaConf.select(config, "hydra.job.name") != "train":
            return  # another rank of an external launcher, or rlkit.eval (its own output dir, no lock)
        run_dir = Path(str(OmegaConf.select(config, "hydra.run.dir"))).expanduser()
        try:
            run_dir.mkdir(parents=True, exist_ok=True)
        except OSError:
            return
        try:
            rundir.check_own_files(run_dir)
            rundir.RunDirLock.for_run(run_dir)  # held until the trainer takes it over, or the process ends
        except RuntimeError as e:  # Hydra turns a callback's exception into a warning and goes on: exit here
            print(f"Error: {type(e).__name__}: {e}", file=sys.stderr, flush=True)
            raise SystemExit(1) from None
        except OSError:  # unwritable: the preflight says so, naming trainer.run_dir
            return


@hydra.main(config_path=str(CONFIG_DIR), config_name="config", version_base=None)
def main(cfg: DictConfig) -> None:
    main_from_config(one_run_dir(cfg))


if __name__ == "__main__":
    main()
