"""A rollout worker process of async mode: a `LocalRollouts` driven by the learner's control messages
(the schedule is in rlkit/rollout/remote/client.py's module doc)."""

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
from rlkit.rollout.remote.wire import bridge, dumps
from rlkit.timing import Timers
from rlkit.weights import receive_weights

# Launcher variables a worker must not inherit from learner rank 0 (it is rank r of its own world).
_LAUNCHER_KEYS = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
                  "GROUP_RANK", "GROUP_WORLD_SIZE", "ROLE_RANK", "ROLE_WORLD_SIZE", "ROLE_NAME")  # fmt: skip


def _control(ctrl, parent: int):
    """The next control message; exits when learner rank 0 (the parent) is gone."""
    while True:
        try:
            return ctrl.get(timeout=1.0)
        except queue.Empty:
            if os.getppid() != parent:
                raise SystemExit("rollout worker: learner rank 0 exited") from None


def worker_main(cfg_dict: dict, r: int, R: int, ports: dict, ctrl, results, start: dict) -> None:
    """Entry of rollout worker `r` of `R` (a spawned process; module level so it pickles)."""
    rollouts = None
    try:
        for key in list(os.environ):
            if key in _LAUNCHER_KEYS or key.startswith("TORCHELASTIC_"):
                del os.environ[key]
        os.environ.update(
            RANK=str(r), WORLD_SIZE=str(R), LOCAL_RANK=str(r), LOCAL_WORLD_SIZE=str(R),
            MASTER_ADDR="127.0.0.1", MASTER_PORT=str(ports["world"]),
        )  # fmt: skip
        if start["gpu"] is not None:
            os.environ["CUDA_VISIBLE_DEVICES"] = str(start["gpu"])
            os.environ["LOCAL_RANK"] = "0"
        # The learner stops the workers after its checkpoint; a signal to the process group must not.
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        logging.basicConfig(level=logging.WARNING, format=f"[rollout worker {r}] %(levelname)s %(message)s")
        if start["threads"]:
            torch.set_num_threads(start["threads"])

        # The learner checked the whole config for its ranks (and the batch split over R workers).
        cfg = parse(cfg_dict)
        device = torch.device("cuda", 0) if start["gpu"] is not None else torch.device("cpu")
        dtype = torch_dtype(cfg.model.dtype)  # the engine's; pushes arrive in it
        if R > 1:
            dist.init_process_group("nccl" if device.type == "cuda" else "gloo", rank=r, world_size=R)
        rollouts = LocalRollouts(
            cfg, rank=r, world=R, device=device, tokenizer=load_tokenizer(cfg.model.path),
            reward_dtype=dtype,
        )  # fmt: skip
        rollouts.order.position = start["position"]
        results.put(dumps(("ready", r)))
        store = dist.TCPStore("127.0.0.1", ports["bridge"], R + 1, False,
                              timeout=datetime.timedelta(seconds=cfg.trainer.collective_timeout_s))  # fmt: skip
        pg = bridge(store, r + 1, R + 1, "nccl" if device.type == "cuda" else "gloo",
                     cfg.trainer.collective_timeout_s)  # fmt: skip

        version, credits, index = -1, 0, start["index"]
        parent = start["parent"]
        while True:
            if credits:
                # A granted batch, generated with the weights held now (the schedule in the module doc).
                timers = Timers()
                sb = rollouts.produce(index, timers)
                sb = dataclasses.replace(sb, policy_version=version)
                results.put(dumps(("batch", r, index, sb, rollouts.order.position, timers.seconds)))
                index, credits = index + 1, credits - 1
                continue
            msg = _control(ctrl, parent)
            if msg[0] == "push":
                _, version, evaluate, grant, manifest = msg
                receive_weights(pg, rollouts.engine, manifest, dtype, device)
                if evaluate:
                    metrics = rollouts.evaluate(version)
                    if r == 0:
                        results.put(dumps(("eval", r, version, metrics)))
                credits += grant
            elif msg[0] == "grant":
                credits += msg[1]
            elif msg[0] == "stop":
                break
    except BaseException as e:
        if not isinstance(e, SystemExit):
            results.put(dumps(("error", r, traceback.format_exc())))
        raise SystemExit(1) from None
    finally:
        if rollouts is not None:
            rollouts.close()
        results.cancel_join_thread()
