"""A rollout worker process of async mode: a `LocalRollouts` driven by the learner's control messages
(Push, Grant, Stop: messages.py; the schedule they follow: schedule.py). A worker that fails sends its
traceback (`WorkerError`) on its own pipe before it exits (messages.py says why that always arrives)."""

from __future__ import annotations

import dataclasses
import datetime
import logging
import os
import queue
import signal
import sys
import traceback
from collections import deque

import torch
import torch.distributed as dist

from rlkit import gcpolicy
from rlkit.config.rules import parse
from rlkit.models import load_tokenizer
from rlkit.rollout.engines import torch_dtype
from rlkit.rollout.local import LocalRollouts, check_engine_probe
from rlkit.rollout.remote.gpu_plan import engine_kwargs_beside_reward_model
from rlkit.rollout.remote.messages import (
    TO_WORKER,
    BatchShare,
    Digests,
    EvalResult,
    Grant,
    Push,
    Ready,
    Stop,
    dumps,
    loads,
    worker_error,
)
from rlkit.rollout.remote.wire import bridge
from rlkit.sandbox.protocol import die_with_parent
from rlkit.timing import Timers
from rlkit.verify import check_engine
from rlkit.weights import receive_weights

# Launcher variables a worker must not inherit from learner rank 0 (it is rank r of its own world).
_LAUNCHER_KEYS = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
                  "GROUP_RANK", "GROUP_WORLD_SIZE", "ROLE_RANK", "ROLE_WORLD_SIZE", "ROLE_NAME")  # fmt: skip


def _control(ctrl, parent: int):
    """The next control message; exits when learner rank 0 (the parent) is gone."""
    while True:
        try:
            return loads(ctrl.get(timeout=1.0), TO_WORKER)
        except queue.Empty:
            if os.getppid() != parent:
                raise SystemExit("rollout worker: learner rank 0 exited") from None


def _as_rank(r: int, R: int, ports: dict, gpu) -> None:
    """Make this process rank `r` of the rollout world of `R` (not a rank of the learner's launch)."""
    for key in list(os.environ):
        if key in _LAUNCHER_KEYS or key.startswith("TORCHELASTIC_"):
            del os.environ[key]
    os.environ.update(RANK=str(r), WORLD_SIZE=str(R), LOCAL_RANK=str(r), LOCAL_WORLD_SIZE=str(R))
    # R > 1: the world's store (`join_world`); a single worker's engine picks its own port.
    if ports["world"] is not None:
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(ports["world"]))
    if gpu is not None:
        os.environ["CUDA_VISIBLE_DEVICES"] = str(gpu)
        os.environ["LOCAL_RANK"] = "0"


def join_world(r: int, R: int, device, timeout_s: float, port: int | None) -> None:
    """Rank `r` of the rollout world of `R` workers (no group for one), met on learner rank 0's store at
    `port`, its collectives bounded by trainer.collective_timeout_s like the learner's."""
    if R > 1:
        backend = "nccl" if device.type == "cuda" else "gloo"
        timeout = datetime.timedelta(seconds=timeout_s)
        store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timeout)
        dist.init_process_group(backend, store=store, rank=r, world_size=R, timeout=timeout)


def worker_rollouts(cfg, r: int, R: int, device) -> LocalRollouts:
    """Worker `r`'s rollouts. On a GPU the engine is not colocated with a learner: it has the GPU to itself
    (its memory share and no sleep mode: rlkit.rollout.engines.vllm.memory.memory_plan), less what a reward
    model on the same GPU needs (gpu_plan.py)."""
    kwargs = engine_kwargs_beside_reward_model(cfg, device)
    if kwargs != dict(cfg.rollout.engine_kwargs or {}):
        cfg = dataclasses.replace(cfg, rollout=dataclasses.replace(cfg.rollout, engine_kwargs=kwargs))
    return LocalRollouts(
        cfg, rank=r, world=R, device=device, tokenizer=load_tokenizer(cfg.model.path),
        reward_dtype=torch_dtype(cfg.model.dtype), colocated=device.type != "cuda",
    )  # fmt: skip


def worker_main(cfg_dict: dict, r: int, R: int, ports: dict, ctrl, results, errors, start: dict) -> None:
    """Entry of rollout worker `r` of `R` (a spawned process; module level so it pickles). `errors` is the
    sending end of this worker's error pipe."""
    rollouts = None
    try:
        # Killed by the kernel when learner rank 0 dies, whatever it is doing: loading its model, or waiting
        # on the learner's store or collectives (up to trainer.collective_timeout_s), where `_control`'s check
        # of the parent is never reached. Its reward workers die with it; its reaper kills what they started.
        die_with_parent(start["parent"], started_by_main_thread=start["main_thread"])
        _as_rank(r, R, ports, start["gpu"])
        # The learner stops the workers after its checkpoint; a signal to the process group must not.
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        logging.basicConfig(level=logging.WARNING, format=f"[rollout worker {r}] %(levelname)s %(message)s")
        if start["threads"]:
            torch.set_num_threads(start["threads"])

        # The learner checked the whole config for its ranks (and the batch split over R workers).
        cfg = parse(cfg_dict)
        device = torch.device("cuda", 0) if start["gpu"] is not None else torch.device("cpu")
        join_world(r, R, device, cfg.trainer.collective_timeout_s, ports["world"])
        with gcpolicy.setup_phase():  # the engine's imports and build without automatic collections
            rollouts = worker_rollouts(cfg, r, R, device)
        rollouts.order.position = start["position"]
        results.put(dumps(Ready(r)))
        store = dist.TCPStore("127.0.0.1", ports["bridge"], R + 1, False,
                              timeout=datetime.timedelta(seconds=cfg.trainer.collective_timeout_s))  # fmt: skip
        pg = bridge(store, r + 1, R + 1, "nccl" if device.type == "cuda" else "gloo",
                     cfg.trainer.collective_timeout_s)  # fmt: skip
        _serve(rollouts, r, pg, ctrl, results, start, device)
    except BaseException as e:
        if not isinstance(e, SystemExit):
            # Written at once (it fits the empty pipe), before anything else can fail or hang.
            errors.send_bytes(dumps(worker_error(r, traceback.format_exc())))
        raise SystemExit(1) from None
    finally:
        errors.close()
        if rollouts is not None:
            rollouts.close()
        results.cancel_join_thread()  # batches still queued are of no use once this worker stops
    # Stopped by the learner, everything this worker started closed: end without the interpreter's teardown of
    # torch and the engine's modules (2-4 s on 2 cores, measured, while the learner waits in its close()).
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _serve(rollouts: LocalRollouts, r: int, pg, ctrl, results, start: dict, device) -> None:
    """Generate the granted batches and follow the control messages until `Stop`."""
    _Server(rollouts, r, pg, ctrl, results, start, device).serve()


class _Server:
    """A worker's control loop. Between batches it handles every message in order. With
    `trainer.inflight_updates` on, the engine also calls `between_steps` after each of its steps during a
    generation: a `Grant` is counted and a `Push` without an evaluation is taken there (weights received,
    checked like every push, the engine's version set, running requests handled by the mode); the first
    message that must wait for the batch (an evaluating `Push`, `Stop`) is held, and so is everything after it."""

    def __init__(self, rollouts: LocalRollouts, r: int, pg, ctrl, results, start: dict, device):
        self.rollouts, self.r, self.pg, self.ctrl, self.results = rollouts, r, pg, ctrl, results
        self.parent, self.device = start["parent"], device
        self.dtype = torch_dtype(rollouts.cfg.model.dtype)  # the engine's; pushes arrive in it
        self.version, self.credits, self.index = -1, 0, start["index"]
        self.checked = None  # the digests of the last verified push (rlkit.verify.check_engine)
        self.held: deque = deque()  # messages read in flight that wait for the batch to finish
        self.swaps = 0  # pushes taken in flight during the current batch
        mode = rollouts.cfg.trainer.inflight_updates
        if mode != "off":
            rollouts.engine.allow_inflight_updates(mode, self.between_steps)

    def serve(self) -> None:
        while True:
            if self.credits:
                # A granted batch, generated with the weights held now, or newer ones taken in flight
                # (the schedule in schedule.py); its policy version is its oldest token's.
                timers, self.swaps = Timers(), 0
                sb = self.rollouts.produce(self.index, timers)
                if self.rollouts.cfg.trainer.inflight_updates != "off":
                    sb = dataclasses.replace(sb, stats={**sb.stats, "inflight/swaps": float(self.swaps)})
                position = self.rollouts.order.position
                self.results.put(dumps(BatchShare(self.r, self.index, sb, position, timers.seconds)))
                self.index, self.credits = self.index + 1, self.credits - 1
                continue
            msg = self.held.popleft() if self.held else _control(self.ctrl, self.parent)
            if isinstance(msg, Push):
                self.take_push(msg, in_flight=False)
                if msg.evaluate:
                    metrics = self.rollouts.evaluate(self.version)
                    if self.r == 0:
                        self.results.put(dumps(EvalResult(self.r, self.version, metrics)))
            elif isinstance(msg, Grant):
                self.credits += msg.count
            elif isinstance(msg, Stop):
                return

    def take_push(self, msg: Push, *, in_flight: bool) -> None:
        """Receive version `msg.version` into the engine, check it (rollout.verify_push) and grant its batches."""
        engine = self.rollouts.engine
        verify = self.rollouts.cfg.rollout.verify_push
        # A run's first push at step 0 brings the weights the engine loaded: none of its tensors
        # may change (check_engine, against the digests taken here).
        loaded = engine.weight_digests() if verify and self.checked is None and msg.version == 0 else None
        receive_weights(self.pg, engine, msg.manifest, self.dtype, self.device)
        if verify:  # the learner's digests of this push come next
            sent = _control(self.ctrl, self.parent)
            if not isinstance(sent, Digests) or sent.version != msg.version:
                raise RuntimeError(
                    f"rollout worker {self.r}: expected the digests of push {msg.version}, got {sent!r}"
                )
            previous = self.checked if loaded is None else {"learner": sent.digests, "engine": loaded}
            self.checked = check_engine(sent.digests, engine, previous)
            if sent.probe is not None and not in_flight:  # (in flight: inside a generation, no probe)
                first = self.version < 0  # the first push brings the weights the engine loaded
                when = "after the first push" if first else f"after the push of version {sent.version}"
                check_engine_probe(
                    engine, sent.probe, getattr(torch, sent.probe_dtype), self.rollouts.cfg.rollout.accept_engine_gap,
                    when=when, at_load=first, tokens=sent.probe_tokens, images=sent.probe_images,
                )  # fmt: skip
        self.version = msg.version
        if in_flight:
            engine.set_version(msg.version, in_flight=True)
        else:
            engine.set_version(msg.version)
        self.credits += msg.grant

    def between_steps(self) -> None:
        """Called by the engine between two of its steps (in-flight updates): take what may be taken now."""
        while not self.held:
            try:
                data = self.ctrl.get_nowait()
            except queue.Empty:
                return
            msg = loads(data, TO_WORKER)
            if isinstance(msg, Grant):
                self.credits += msg.count
            elif isinstance(msg, Push) and not msg.evaluate:
                self.take_push(msg, in_flight=True)
                self.swaps += 1
            else:
                self.held.append(msg)
