"""A hung rank must not hang everyone.

Every collective waits at most `trainer.collective_timeout_s` (the process group's timeout, set in
`rlkit.learner.make_accelerator`; rlkit's own collectives also wait on the host with it). On NCCL the timeout
reaches Python only with TORCH_NCCL_ASYNC_ERROR_HANDLING=2, which make_accelerator sets (see
`let_nccl_timeouts_reach_python`); otherwise torch's watchdog thread ends the process first. When one times out, `CollectiveWatch.explain` finds out which ranks stopped
with a monitored barrier on a gloo group of its own (gloo's `monitored_barrier` names the ranks that did not
arrive; the main group may be NCCL, or left in an undefined state by the failed collective), and every live
rank ends with an error saying so. Rank 0 ends a stopped rank that runs on its own machine (SIGKILL: a hung or
SIGSTOPped process acts on nothing else); the launcher (rlkit's own, or torchrun) then ends the ranks that are
left, and their reward workers die with them (rlkit.rewards). Without that kill, torch's launcher waits a fixed
30 s after a failure before it SIGKILLs a stopped rank, whatever its `shutdown_timeout` says.
"""

from __future__ import annotations

import logging
import os
import re
import signal
import sys
import time
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

log = logging.getLogger(__name__)


class CollectiveTimeout(RuntimeError):
    """A collective waited longer than trainer.collective_timeout_s: a rank stopped, hung or died."""


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now (for a rendezvous started right after)."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def is_timeout(error: BaseException) -> bool:
    """Whether `error` is a collective that waited too long: gloo's and a blocking NCCL wait's timeout, or the
    error of an NCCL communicator the watchdog aborted after its timeout (TORCH_NCCL_ASYNC_ERROR_HANDLING=2)."""
    text = str(error).lower()
    return "timed out" in text or "timeout" in text or "communicator was aborted" in text


# TORCH_NCCL_ASYNC_ERROR_HANDLING (torch/csrc/distributed/c10d/ProcessGroupNCCL.hpp): 1 TearDown and 3
# SkipCleanUp (torch's default; torchrun's launcher sets 1) make NCCL's watchdog thread rethrow a collective's
# timeout, which ends the process before any Python code runs; 2 CleanUpOnly aborts the communicator and lets
# the timeout reach the waiting thread, so that `CollectiveWatch.explain` can name the stopped rank.
NCCL_ERROR_HANDLING = "TORCH_NCCL_ASYNC_ERROR_HANDLING"
NCCL_CLEAN_UP_ONLY = "2"


def let_nccl_timeouts_reach_python() -> str | None:
    """Before the NCCL process group is created (the variable is read then): CleanUpOnly, unless the user chose
    0 (no handling) or 3; the launcher's default 1 is replaced. Returns the value it replaced, if any."""
    before = os.environ.get(NCCL_ERROR_HANDLING)
    if before in (None, "", "1"):
        os.environ[NCCL_ERROR_HANDLING] = NCCL_CLEAN_UP_ONLY
        return before
    return None


# torch's NCCL heartbeat monitor (TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC, default 480 s, ProcessGroupNCCL.hpp) ends
# every rank that long after a collective's timeout: `CollectiveWatch.explain` must have named the stopped rank
# before it. Its barrier waits at most this share of the heartbeat (the rest: the message, the kill, the exit).
NCCL_HEARTBEAT = "TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC"
NCCL_HEARTBEAT_DEFAULT_S = 480.0
BARRIER_SHARE_OF_HEARTBEAT = 0.5


def nccl_heartbeat_s() -> float:
    """NCCL's heartbeat timeout in this process (torch's default when the variable is unset or unreadable)."""
    try:
        return float(os.environ.get(NCCL_HEARTBEAT, NCCL_HEARTBEAT_DEFAULT_S))
    except ValueError:
        return NCCL_HEARTBEAT_DEFAULT_S


def barrier_timeout_s(collective_timeout_s: float, heartbeat_s: float | None = None) -> float:
    """How long `CollectiveWatch.explain`'s monitored barrier waits for the ranks: trainer.collective_timeout_s,
    but at most half of NCCL's heartbeat timeout, so that the explanation prints before the heartbeat monitor
    ends the process (with the defaults: 240 s, where 600 s never printed)."""
    heartbeat = nccl_heartbeat_s() if heartbeat_s is None else heartbeat_s
    return min(collective_timeout_s, BARRIER_SHARE_OF_HEARTBEAT * heartbeat)


_host_timeout: timedelta | None = None  # trainer.collective_timeout_s, set by CollectiveWatch


def _wait(work) -> None:
    """Block this thread until `work` is done, at most trainer.collective_timeout_s: an NCCL `wait()` without a
    timeout only orders the CUDA stream (the host goes on, and the timeout would be the watchdog's alone);
    with one it blocks and raises the timeout here, where `CollectiveWatch.explain` catches it."""
    if _host_timeout is None:
        work.wait()
    else:
        work.wait(_host_timeout)


class CollectiveWatch:
    """Built on every rank at start-up (a collective call); `explain(error)` after a failure."""

    def __init__(self, world_size: int, timeout_s: float):
        global _host_timeout
        self.timeout_s = timeout_s
        _host_timeout = timedelta(seconds=timeout_s)
        self.group = None
        self.places: list = []  # process_place() of every rank
        if world_size > 1 and dist.is_available() and dist.is_initialized():
            self.group = dist.new_group(backend="gloo", timeout=timedelta(seconds=timeout_s))
            self.places = [None] * world_size
            dist.all_gather_object(self.places, process_place(), group=self.group)

    def explain(self, error: BaseException) -> CollectiveTimeout | None:
        """A CollectiveTimeout naming the stopped ranks when `error` is a collective timeout, else None."""
        if self.group is None or not is_timeout(error):
            return None
        rank = dist.get_rank()
        wait_s = barrier_timeout_s(self.timeout_s)
        log.error("rank %d: a collective timed out; checking which ranks still respond (%g s)", rank, wait_s)
        try:
            dist.monitored_barrier(group=self.group, timeout=timedelta(seconds=wait_s), wait_all_ranks=True)
            who = "every rank responds again (one was slower than the timeout)"
        except RuntimeError as e:
            who = stopped_ranks_message(str(e), rank) + self._end_local(stopped_ranks(str(e)))
        message = (
            f"rank {rank}: a collective waited longer than trainer.collective_timeout_s={self.timeout_s:g}s: {who}. "
            "Ending this rank; the launcher ends the others."
        )
        print(message, file=sys.stderr, flush=True)  # a launcher may report only another rank's error
        return CollectiveTimeout(message)

    def _end_local(self, ranks: list[int]) -> str:
        """SIGKILL the stopped `ranks` that run on this machine (rank 0 only: it hears from every rank):
        only a process this one can name for certain (same kernel boot, same pid namespace, the pid's
        start time unchanged), so never another machine's or a reused pid. Returns what was done, for the
        message."""
        ended = []
        for r in ranks:
            place = self.places[r] if 0 < r < len(self.places) else None
            if place is None or process_place(place[2]) != place:
                continue
            try:
                os.kill(place[2], signal.SIGKILL)
                ended.append(f"rank {r} (pid {place[2]})")
            except OSError:  # already gone
                pass
        return f"; ended {', '.join(ended)} on this machine with SIGKILL" if ended else ""


def process_place(pid: int | None = None) -> tuple[str, str, int, str] | None:
    """(kernel boot id, pid namespace, pid, start time) of process `pid` (this one by default), which names
    it uniquely across machines, containers and pid reuse; None where /proc does not tell (not Linux, or
    the process is gone)."""
    pid = os.getpid() if pid is None else pid
    try:
        boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
        namespace = os.readlink("/proc/self/ns/pid")  # the namespace `pid` is read in
        start = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return None
    return boot, namespace, pid, start


def stopped_ranks(barrier_error: str) -> list[int]:
    """The ranks gloo's monitored_barrier error (on rank 0) lists as never arrived."""
    m = re.search(r"Ranks? ([\d, ]+) failed to pass monitoredBarrier", barrier_error)
    return [int(r) for r in re.findall(r"\d+", m.group(1))] if m else []


def stopped_ranks_message(barrier_error: str, rank: int) -> str:
    """What gloo's monitored_barrier error says about the missing ranks, in plain words."""
    if ranks := stopped_ranks(barrier_error):  # rank 0 hears from everyone: the ranks listed never arrived
        return f"rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))} stopped responding"
    if rank != 0:  # other ranks only hear from rank 0
        return "rank 0 stopped responding (or reported another rank: see its message)"
    return (
        f"the ranks could not be checked ({barrier_error.splitlines()[0] if barrier_error else 'no detail'})"
    )


# -- every collective rlkit makes (tests/layout/test_collectives_source.py holds that none is made elsewhere) ---
#
# NCCL takes CUDA tensors only (`No backend type associated with device type cpu`); gloo takes host tensors,
# so a CPU run never shows a host tensor that a GPU run would refuse. Every tensor collective therefore takes
# the device its tensor must be on as a required argument (the learner's device: cuda:LOCAL_RANK under NCCL),
# places the tensor there, and refuses by name a non-CUDA device on an NCCL group before NCCL does.


class CollectiveDeviceError(RuntimeError):
    """A collective was given a device its process group's backend does not take (the CPU under NCCL)."""


def _backend(group) -> str | None:
    """The backend of `group` (a process group of the default world, or a bridge `ProcessGroup*` object)."""
    nccl = getattr(dist, "ProcessGroupNCCL", None)  # absent from CPU builds of torch
    if group is not None and not isinstance(group, dist.ProcessGroup):
        return "nccl" if nccl is not None and isinstance(group, nccl) else "gloo"
    if not (dist.is_available() and dist.is_initialized()):
        return None
    return dist.get_backend(group)


def placed(x: torch.Tensor, device, group=None) -> torch.Tensor:
    """`x` on `device`, contiguous, after checking that the backend of `group` takes tensors there."""
    device = torch.device(device)
    if _backend(group) == "nccl" and device.type != "cuda":
        raise CollectiveDeviceError(
            f"a collective on an NCCL group was given device {device} for a {tuple(x.shape)} tensor on "
            f"{x.device}: NCCL takes CUDA tensors only; pass the learner's device (cuda:LOCAL_RANK)"
        )
    return x.to(device).contiguous()


def broadcast_object(obj, world: int):
    """Rank 0's `obj` on every rank (torch sends it through the backend's device itself)."""
    if world == 1:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def scatter_object(items: list | None, world: int, src: int = 0):
    """Rank `src`'s `items[r]` on rank r (`items` is read on `src` only)."""
    if world == 1:
        return items[0]
    box = [None]
    dist.scatter_object_list(box, items, src=src)
    return box[0]


def gather_objects(obj, world: int) -> list:
    """Every rank's `obj`, in rank order, on every rank."""
    if world == 1:
        return [obj]
    out: list = [None] * world
    dist.all_gather_object(out, obj)
    return out


def all_gather_cat(x: torch.Tensor, world: int, device, *, group=None) -> torch.Tensor:
    """Concatenate a per-rank [n, ...] tensor over ranks in rank order (same shape on every rank), on `device`."""
    if world == 1:
        return x
    x = placed(x, device, group)
    out = [torch.empty_like(x) for _ in range(world)]
    _wait(dist.all_gather(out, x, group=group, async_op=True))
    return torch.cat(out)


def all_reduce(x: torch.Tensor, world: int, device, *, op=dist.ReduceOp.SUM, group=None) -> torch.Tensor:
    """`x` reduced over ranks, a new tensor on `device` (`x` is left untouched)."""
    if world == 1:
        return x
    x = placed(x, device, group).clone()
    _wait(dist.all_reduce(x, op=op, group=group, async_op=True))
    return x


def broadcast(pg, x: torch.Tensor, device, src: int = 0):
    """Broadcast `x` from `src` over the process-group object `pg` (the async weight bridge: rlkit.weights),
    on `device`. Returns (the tensor sent or filled, its work). Under NCCL `wait()` only orders the current
    CUDA stream after the broadcast and returns at once, whether or not the peers take part: `wait_on_host`
    waits for it to finish."""
    x = placed(x, device, pg)
    work = pg.broadcast(x, src)
    work.wait()
    return x, work


def wait_on_host(
    work, timeout_s: float, alive: Callable[[], None] | None = None, poll_s: float = 0.2
) -> None:
    """Block the host until `work` has finished (NCCL's works finish in the order they were issued on a
    group, so the last one stands for all), calling `alive()` between polls (it raises to name a peer that
    died: an NCCL collective with a dead peer never finishes and raises nothing); CollectiveTimeout after
    `timeout_s` (trainer.collective_timeout_s)."""
    deadline = time.monotonic() + timeout_s
    while not work.is_completed():
        if alive is not None:
            alive()
        if time.monotonic() > deadline:
            raise CollectiveTimeout(
                f"a weight broadcast did not finish within trainer.collective_timeout_s={timeout_s:g}s"
            )
        time.sleep(poll_s)


class StartupGate:
    """Ranks 1..N-1 wait here, outside any collective, while rank 0 does something long alone (async mode:
    start the rollout workers, whose engines compile and capture graphs). A collective would bound the wait
    by the process group's timeout (NCCL's watchdog ends the process after it); this waits on a TCPStore that
    rank 0 serves, with no bound: if rank 0 fails it exits, its store goes with it and the waiting ranks raise
    (and the launcher ends every rank of a failed run anyway). Built by every rank at once (one broadcast)."""

    KEY = "rlkit/open"

    def __init__(self, rank: int, world: int, what: str):
        self.rank, self.what = rank, what
        self.store = dist.TCPStore("127.0.0.1", 0, world, True, wait_for_workers=False) if rank == 0 else None
        port = broadcast_object(self.store.port if rank == 0 else None, world)
        host = os.environ.get("MASTER_ADDR", "127.0.0.1")
        if rank != 0:
            self.store = dist.TCPStore(host, port, world, False, timeout=timedelta(seconds=60))

    def open(self) -> None:
        """Rank 0: let the others go."""
        self.store.set(self.KEY, "1")

    def wait(self, poll_s: float = 60.0) -> None:
        """Ranks 1..N-1: return once rank 0 has called `open` (logged every `poll_s` while waiting)."""
        start = time.monotonic()
        while True:
            try:
                self.store.wait([self.KEY], timedelta(seconds=poll_s))
                return
            except RuntimeError as e:  # DistStoreError: a timeout (wait again) or rank 0's store is gone
                if not is_timeout(e):
                    raise RuntimeError(
                        f"rank {self.rank}: rank 0 stopped while it {self.what} ({e})"
                    ) from None
            log.info(
                "rank %d: waiting for rank 0, which %s (%.0f s)",
                self.rank,
                self.what,
                time.monotonic() - start,
            )
