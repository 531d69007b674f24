"""Metric sinks: Weights & Biases (offline automatically without an API key, or when its host cannot be
reached), console, or none.

Whatever the sink, `<run_dir>/metrics.jsonl` gets one JSON line per step (rlkit/plots.py draws curves.png from it):
a write that fails (a full disk) ends the run with an error naming the file. W&B is a mirror: its failures (a
full disk under its folder, a dead service) are logged once and never end a run; `check_config` imports wandb
at start-up, so a broken install stops the run before any model loads. Only rank 0 logs; metrics arrive
already reduced across ranks (rlkit.metrics.MetricMerger).
"""

from __future__ import annotations

import json
import logging
import math
import netrc
import os
import socket
import subprocess
import threading
import urllib.request
from pathlib import Path
from urllib.parse import urlsplit

from rlkit.config.schema import ConfigError
from rlkit.rundir import METRICS_FILE, SAMPLES_FILE, open_own

log = logging.getLogger(__name__)

BACKENDS = ("wandb", "console", "none")  # logger.backend

REACH_TIMEOUT_S = 5.0
"""How long the start-up check may wait for a TCP connection to the W&B host (DNS included)."""
INIT_TIMEOUT_S = 30.0
"""wandb.init's own timeout (wandb's default is 90 s, after which the run aborted); then offline."""


def git_commit(cwd: str | Path | None = None) -> str | None:
    """The commit of the code being run (None outside a git checkout)."""
    try:
        out = subprocess.run(
            ["git", "rev-parse", "HEAD"],
            cwd=cwd or Path(__file__).resolve().parent,
            capture_output=True,
            text=True,
            timeout=5,
        )
        return out.stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        return None


def wandb_logged_in() -> bool:
    """True when W&B has an API key (env var or a netrc login for its host)."""
    if os.environ.get("WANDB_API_KEY"):
        return True
    host = os.environ.get("WANDB_BASE_URL", "https://api.wandb.ai").split("://")[-1].split("/")[0]
    try:
        return netrc.netrc().authenticators(host) is not None
    except (OSError, netrc.NetrcParseError):
        return False


def wandb_reachable(timeout: float = REACH_TIMEOUT_S) -> tuple[bool, str]:
    """(whether a TCP connection to the W&B host opens within `timeout` seconds, why not).

    The host is WANDB_BASE_URL's (default api.wandb.ai), or the proxy the environment routes it
    through. Without a network wandb.init waits 90 s and then aborts the run; this answers in seconds.
    """
    base = urlsplit(os.environ.get("WANDB_BASE_URL", "https://api.wandb.ai"))
    host, port = base.hostname or "", base.port or (443 if base.scheme == "https" else 80)
    proxy = urllib.request.getproxies().get(base.scheme)
    if proxy and not urllib.request.proxy_bypass(host):
        p = urlsplit(proxy if "://" in proxy else f"http://{proxy}")
        host, port = p.hostname or "", p.port or 80
    failure: list[str] = []

    def probe():
        try:
            socket.create_connection((host, port), timeout=timeout).close()
        except OSError as e:
            failure.append(f"{host}:{port}: {type(e).__name__}: {e}")

    # A thread bounds the DNS lookup too, which socket timeouts do not cover.
    thread = threading.Thread(target=probe, daemon=True)
    thread.start()
    thread.join(timeout)
    if thread.is_alive():
        return False, f"{host}:{port}: no answer within {timeout:g} s"
    return not failure, (failure[0] if failure else "")


def check_config(cfg) -> None:
    """logger.backend=wandb: wandb must import (a missing or broken install is named here, before any model
    loads, not when the logger starts after them)."""
    if cfg.logger.backend != "wandb":
        return
    try:
        import wandb  # noqa: F401
    except Exception as e:  # ImportError, or whatever a broken install raises while importing
        raise ConfigError(
            f"logger.backend='wandb' but wandb does not import ({type(e).__name__}: {e}): install it "
            f"(pip install wandb) or choose another of {list(BACKENDS)}"
        ) from e


class MetricsFileError(OSError):
    """A write to metrics.jsonl or samples.jsonl failed (a full disk): the message names the file."""


def _append(handle, path: Path, text: str) -> None:
    try:
        handle.write(text)
        handle.flush()
    except OSError as e:
        raise MetricsFileError(e.errno, f"cannot write {path}: {e.strerror or e}") from e


def _jsonable(v):
    if isinstance(v, float) and not math.isfinite(v):
        return str(v)
    return v


class MetricsLogger:
    """Logs one dict of floats per step to the chosen backend and to `<run_dir>/metrics.jsonl`.

    Args:
        backend: wandb | console | none.
        run_dir: run directory (metrics.jsonl is appended to, so a resumed run continues the file).
        config: the resolved config (stored with the W&B run, with the git commit).
        project / entity / name / tags: W&B run settings.
        resume_id: W&B run id of the run being resumed (the same W&B run continues).
    """

    def __init__(
        self,
        backend: str,
        run_dir: str | Path,
        config: dict,
        *,
        project: str = "rlkit",
        entity: str | None = None,
        name: str | None = None,
        tags: list[str] | None = None,
        resume_id: str | None = None,
    ):
        self.backend = backend
        self.run_dir = Path(run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self._jsonl_path = self.run_dir / METRICS_FILE
        self._jsonl = open_own(self._jsonl_path, "a")  # never through a symlink
        self._wandb_failed: set[str] = set()  # the W&B calls that failed (each is logged once)
        self.run = None
        self.run_id: str | None = resume_id
        if backend == "wandb":
            import wandb

            mode = os.environ.get("WANDB_MODE")
            if mode is None and not wandb_logged_in():
                mode = "offline"
                print("W&B: no API key found (WANDB_API_KEY / `wandb login`): logging offline.", flush=True)
            elif mode in (None, "online", "run"):
                reachable, why = wandb_reachable()
                if not reachable:
                    mode = "offline"
                    log.warning("W&B: cannot reach the server (%s): logging offline instead", why)
            kwargs = dict(
                project=project,
                entity=entity,
                name=name,
                tags=tags,
                dir=os.environ.get("WANDB_DIR", str(self.run_dir)),
                config={**config, "git_commit": git_commit()},
                id=resume_id,
                resume="allow" if resume_id else None,
            )
            try:
                self.run = wandb.init(
                    **kwargs, mode=mode, settings=wandb.Settings(init_timeout=INIT_TIMEOUT_S)
                )
            except Exception as e:  # reachable but not answering (or refusing): keep the run going
                if mode in ("offline", "disabled"):
                    raise
                log.warning("W&B: wandb.init failed (%s: %s): logging offline instead", type(e).__name__, e)
                mode = "offline"
                wandb.teardown()  # a fresh wandb service: the failed one still holds the online stream
                self.run = wandb.init(**kwargs, mode=mode)
            self.run_id = self.run.id
            if mode == "offline":
                run_path = Path(self.run.dir).parent
                print(f"W&B: offline run in {run_path}; upload later with: wandb sync {run_path}", flush=True)
        elif backend not in BACKENDS:
            raise ValueError(f"logger.backend={backend!r} is not one of {list(BACKENDS)}")

    def _wandb(self, what: str, call, *args, **kwargs) -> None:
        """A W&B call that cannot end the run: a failure is logged once per kind of call (metrics.jsonl holds
        every step whatever W&B does)."""
        try:
            call(*args, **kwargs)
        except Exception as e:
            if what not in self._wandb_failed:
                self._wandb_failed.add(what)
                log.warning(
                    "W&B: %s failed (%s: %s); the run goes on, %s has every step", what, type(e).__name__, e,
                    self._jsonl_path,
                )  # fmt: skip

    def log(self, metrics: dict[str, float], step: int) -> None:
        line = json.dumps({"step": step, **{k: _jsonable(v) for k, v in metrics.items()}}) + "\n"
        _append(self._jsonl, self._jsonl_path, line)
        if self.run is not None:
            self._wandb("run.log", self.run.log, metrics, step=step)
        elif self.backend == "console":
            shown = " ".join(
                f"{k}={v:.4g}" for k, v in sorted(metrics.items()) if isinstance(v, (int, float))
            )
            print(f"[step {step}] {shown}", flush=True)

    def log_samples(self, rows: list[dict], step: int, kind: str) -> None:
        """Append `rows` (rlkit/rollout/samples.py) to `<run_dir>/samples.jsonl` and log them as the W&B table
        `samples/<kind>` (train or eval) at `step`."""
        if not rows:
            return
        path = self.run_dir / SAMPLES_FILE
        with open_own(path, "a") as f:  # never through a symlink
            _append(f, path, "".join(json.dumps(row) + "\n" for row in rows))
        if self.run is not None:
            import wandb

            columns = ["step", "prompt", "response", "reward", "parts", "correct", "finish_reason", "length"]
            table = wandb.Table(
                columns=columns,
                data=[[json.dumps(r[c]) if c == "parts" else r[c] for c in columns] for r in rows],
            )
            self._wandb("run.log (samples)", self.run.log, {f"samples/{kind}": table}, step=step)

    def close(self) -> None:
        self._jsonl.close()
        if self.run is not None:
            run, self.run = self.run, None
            self._wandb("run.finish", run.finish)
