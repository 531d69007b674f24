"""The worker protocol every sandboxed worker process speaks (reward workers: rlkit/rewards/scorer.py;
environment workers: rlkit/envs/workers.py; async rollout workers use `die_with_parent`): it dies with
its parent, says "ready", answers each request on its pipe, and a dead one's exit is said in words.
Imports nothing heavy: worker processes load it at start.
"""

from __future__ import annotations

import time


def die_with_parent(parent_pid: int, *, started_by_main_thread: bool = True) -> None:
    """Linux: the kernel SIGKILLs this process when its parent dies, so no worker outlives the trainer.

    PR_SET_PDEATHSIG fires when the *thread* that started this process exits, not the process. A worker
    started from another thread (a user's thread pool scoring with a RewardScorer) would die with that
    thread while the trainer lives on, so it watches its parent's pid instead (every 0.5 s)."""
    import ctypes
    import os
    import signal

    if not started_by_main_thread:
        import threading

        def watch() -> None:
            while os.getppid() == parent_pid:
                time.sleep(0.5)
            os._exit(1)

        threading.Thread(target=watch, daemon=True, name="rlkit-parent-watch").start()
        return
    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, int(signal.SIGKILL))  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        return  # not Linux: an idle worker still exits when its pipe closes (EOF)
    if os.getppid() != parent_pid:  # the parent died before prctl took effect
        os._exit(1)


def read_reply(conn):
    """A worker's next message, or None when it is dead (its sentinel fired or its pipe broke)."""
    try:
        return conn.recv() if conn.poll() else None
    except (EOFError, OSError):
        return None


def serve_requests(conn, handle) -> None:
    """A worker process's loop (reward and environment workers): say "ready", then answer each request on
    `conn` with `handle(request)` until a None request or the pipe closes. A process the handler forked
    (os.fork in an environment) that returns here exits at once: only the worker answers on its pipe."""
    import os

    me = os.getpid()
    conn.send("ready")
    while True:
        try:
            request = conn.recv()
        except (EOFError, OSError):
            return
        if request is None:
            return
        reply = handle(request)
        if os.getpid() != me:
            os._exit(0)
        conn.send(reply)


def exit_reason(code: int | None) -> str:
    """A dead worker's exit code in words: `exit code 7`, or the signal that killed it (SIGKILL: the
    kernel's OOM killer, a cgroup limit or a kill -9)."""
    import signal

    if code is not None and code < 0:
        try:
            name = signal.Signals(-code).name
        except ValueError:
            name = f"signal {-code}"
        hint = " (the OOM killer, or kill -9)" if -code == signal.SIGKILL else ""
        return f"killed by {name}{hint}"
    return f"exit code {code}"
