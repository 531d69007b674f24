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
import traceback

import torch
import torch.distributed as dist

from rlkit.config.rules import parse
from rlkit.models import load_tokenizer
from rlkit.rollout.engines import torch_dtype
from rlkit.rollout.local import LocalRollouts
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
from rlkit.timing import Timers
from rlkit.weights import check_engine, receive_weights

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
    os.environ.update(
        RANK=str(r), WORLD_SIZE=str(R), LOCAL_RANK=str(r), LOCAL_WORLD_SIZE=str(R),
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(ports["world"]),
    )  # fmt: skip
    if gpu is not None:
        os.environ["CUDA_VISIBLE_DEVICES"] = str(gpu)
        os.environ["LOCAL_RANK"] = "0"


def worker_main(cfg_dict: dict, r: int, R: int, ports: dict, ctrl, results, errors, start: dict) -> None:
    """Entry of rollout worker `r` of `R` (a spawned process; module level so it pickles). `errors` is the
    sending end of this worker's error pipe."""
    rollouts = None
    try:
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
        if R > 1:
            dist.init_process_group("nccl" if device.type == "cuda" else "gloo", rank=r, world_size=R)
        rollouts = LocalRollouts(
            cfg, rank=r, world=R, device=device, tokenizer=load_tokenizer(cfg.model.path),
            reward_dtype=torch_dtype(cfg.model.dtype),
        )  # fmt: skip
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


def _serve(rollouts: LocalRollouts, r: int, pg, ctrl, results, start: dict, device) -> None:
    """Generate the granted batches and follow the control messages until `Stop`."""
    dtype = torch_dtype(rollouts.cfg.model.dtype)  # the engine's; pushes arrive in it
    version, credits, index = -1, 0, start["index"]
    checked = None  # the digests of the last verified push (rlkit.weights.check_engine)
    while True:
        if credits:
            # A granted batch, generated with the weights held now (the schedule in schedule.py).
            timers = Timers()
            sb = rollouts.produce(index, timers)
            sb = dataclasses.replace(sb, policy_version=version)
            results.put(dumps(BatchShare(r, index, sb, rollouts.order.position, timers.seconds)))
            index, credits = index + 1, credits - 1
            continue
        msg = _control(ctrl, start["parent"])
        if isinstance(msg, Push):
            version = msg.version
            receive_weights(pg, rollouts.engine, msg.manifest, dtype, device)
            if rollouts.cfg.rollout.verify_push:  # the learner's digests of this push come next
                sent = _control(ctrl, start["parent"])
                if not isinstance(sent, Digests) or sent.version != version:
                    raise RuntimeError(
                        f"rollout worker {r}: expected the digests of push {version}, got {sent!r}"
                    )
                checked = check_engine(sent.digests, rollouts.engine, checked)
            if msg.evaluate:
                metrics = rollouts.evaluate(version)
                if r == 0:
                    results.put(dumps(EvalResult(r, version, metrics)))
            credits += msg.grant
        elif isinstance(msg, Grant):
            credits += msg.count
        elif isinstance(msg, Stop):
            return
