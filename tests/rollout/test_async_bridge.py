"""The async weight bridge and start-up on GPUs, shown on CPU: recorders stand in
for the NCCL process groups; the start-up wait runs in two real gloo processes."""

from __future__ import annotations

import datetime
import time

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from rlkit.collectives import free_port
from rlkit.config.schema import RLConfig
from rlkit.rollout.remote import client, wire, worker
from rlkit.weights import Export

pytestmark = pytest.mark.slow  # starts gloo processes: `make test-fast` leaves it out

TIMEOUT_S = 42.0


def test_the_nccl_bridge_carries_the_collective_timeout(monkeypatch):
    made = []

    class RecordingNCCL:  # torch.distributed.ProcessGroupNCCL, absent from CPU builds
        class Options:
            _timeout = None

        def __init__(self, store, rank, size, options=None):
            made.append((rank, size, options))

    monkeypatch.setattr(dist, "ProcessGroupNCCL", RecordingNCCL, raising=False)
    wire.bridge(object(), 0, 3, "nccl", TIMEOUT_S)
    ((rank, size, options),) = made
    assert (rank, size) == (0, 3) and options._timeout == datetime.timedelta(seconds=TIMEOUT_S)


def test_the_rollout_world_carries_the_collective_timeout(monkeypatch):
    calls = []
    monkeypatch.setattr(dist, "init_process_group", lambda *a, **kw: calls.append((a, kw)))
    held = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)  # learner rank 0's
    worker.join_world(1, 2, torch.device("cpu"), TIMEOUT_S, held.port)
    worker.join_world(0, 1, torch.device("cpu"), TIMEOUT_S, None)  # one worker: no world
    ((args, kw),) = calls
    store = kw.pop("store")
    assert args == ("gloo",) and kw == {
        "rank": 1,
        "world_size": 2,
        "timeout": datetime.timedelta(seconds=TIMEOUT_S),
    }
    assert store.port == held.port  # the store bound before the workers started, never a port chosen later
    store.set("k", "v")
    assert held.get("k") == b"v"


class Proc:
    exitcode = None


class NCCLLikeBridge:
    """Each broadcast is queued and `wait()` returns at once, as NCCL's does on the host; with a receiver gone
    the broadcasts never finish. Worker 1 dies (kill -9) during the first one."""

    def __init__(self, procs):
        self.procs, self.sent = procs, 0

    def broadcast(self, x, src):
        self.sent += 1
        self.procs[1].exitcode = -9
        return self

    def wait(self):
        return True

    def is_completed(self):
        return False


class Queue:
    def put(self, item):
        pass


def test_a_worker_that_dies_mid_push_is_named_when_the_broadcast_does_not_block(monkeypatch):
    cfg = RLConfig()
    cfg.model.dtype, cfg.trainer.mode, cfg.trainer.collective_timeout_s = "float32", "async", 30.0
    rollouts = client.AsyncRollouts(cfg, rank=0, world=1, device=torch.device("cpu"))
    rollouts.backend = "nccl"
    rollouts.procs, rollouts.ctrl = [Proc(), Proc()], [Queue(), Queue()]
    rollouts.pg = NCCLLikeBridge(rollouts.procs)
    weights = {"a": torch.ones(2, 3), "b": torch.zeros(4)}
    export = Export({k: tuple(v.shape) for k, v in weights.items()}, lambda: iter(weights.items()))
    start = time.monotonic()
    with pytest.raises(RuntimeError, match="rollout worker 1 exited with code -9"):
        rollouts.push(export, 1)
    # Named at once, not after the timeout, with rollout.verify_push (the default): every broadcast is queued and
    # the digests stay on the device until the wait on the last one, which polls the workers' liveness (a copy to
    # the host before it would wait behind the unfinished broadcast: tests/rollout/test_push_liveness.py).
    assert cfg.rollout.verify_push and rollouts.pg.sent == 2 and time.monotonic() - start < 10
    rollouts.close = lambda: None


def _two_ranks(rank: int, port: int, spawn_s: float, out) -> None:
    """Rank 0 starts the workers (faked: it takes spawn_s, longer than the group's 1 s timeout); then every rank
    pushes (faked: one all-reduce, the collective the first FSDP2 gather is)."""
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2,
        timeout=datetime.timedelta(seconds=1),
    )  # fmt: skip
    cfg = RLConfig()
    cfg.model.dtype, cfg.trainer.mode = "float32", "async"
    rollouts = client.AsyncRollouts(cfg, rank=rank, world=2, device=torch.device("cpu"))
    rollouts._spawn = lambda: time.sleep(spawn_s)
    rollouts.push = lambda export, step, evaluate=False: dist.all_reduce(torch.ones(1))
    try:
        rollouts.start(None, 0)
        out.put((rank, "ok"))
    except Exception as e:
        out.put((rank, f"{type(e).__name__}: {e}"))
    dist.destroy_process_group()


def test_learner_ranks_wait_for_the_workers_outside_any_collective():
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_two_ranks, args=(r, port, 3.0, out)) for r in range(2)]
    for p in procs:
        p.start()
    results = dict(out.get(timeout=120) for _ in procs)
    for p in procs:
        p.join(timeout=60)
    assert results == {0: "ok", 1: "ok"}, results
