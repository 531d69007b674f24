"""W&B with an API key but no reachable server falls back to offline within seconds, with a warning, and
the metrics are still written (metrics.jsonl and the offline W&B run). Only loopback is ever contacted:
the server URL is a closed or a silent port on 127.0.0.1, and proxies and error reporting are off."""

import json
import os
import socket
import time

import pytest

from rlkit import logging as rl_logging
from rlkit.logging import MetricsLogger, wandb_reachable


@pytest.fixture
def wandb_env(monkeypatch, tmp_path):
    for name in list(os.environ):
        if name.lower().endswith("_proxy") or name.startswith("WANDB_"):
            monkeypatch.delenv(name)
    monkeypatch.setenv("WANDB_API_KEY", "0123456789abcdef0123456789abcdef01234567")  # a fake key
    monkeypatch.setenv("WANDB_ERROR_REPORTING", "false")  # no crash reports to sentry
    monkeypatch.setenv("WANDB_DIR", str(tmp_path / "wb"))


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]  # closed when the socket is: connections are refused


def _log_two_steps(run_dir):
    logger = MetricsLogger("wandb", run_dir, {"lr": 1e-3}, project="p", name="offline-test")
    try:
        for step in (1, 2):
            logger.log({"reward/mean": 0.25 * step}, step=step)
        mode = logger.run.settings.mode
    finally:
        logger.close()
    return mode


def _check_written(tmp_path, run_dir):
    from wandb_files import history

    lines = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert lines == [{"step": 1, "reward/mean": 0.25}, {"step": 2, "reward/mean": 0.5}]
    (wandb_file,) = (tmp_path / "wb").glob("wandb/offline-run-*/run-*.wandb")
    assert [r["reward/mean"] for r in history(wandb_file)] == [0.25, 0.5]


def test_reachability_check_on_loopback():
    port = _closed_port()
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("WANDB_BASE_URL", f"http://127.0.0.1:{port}")
        for name in list(os.environ):
            if name.lower().endswith("_proxy"):
                mp.delenv(name)
        start = time.perf_counter()
        ok, why = wandb_reachable(timeout=2.0)
        assert not ok and f"127.0.0.1:{port}" in why and "Refused" in why
        assert time.perf_counter() - start < 2.0
        with socket.socket() as server:
            server.bind(("127.0.0.1", 0))
            server.listen()
            mp.setenv("WANDB_BASE_URL", f"http://127.0.0.1:{server.getsockname()[1]}")
            assert wandb_reachable(timeout=2.0) == (True, "")


def test_key_set_and_server_unreachable_logs_offline_within_seconds(wandb_env, monkeypatch, tmp_path, caplog):
    monkeypatch.setenv("WANDB_BASE_URL", f"http://127.0.0.1:{_closed_port()}")
    start = time.perf_counter()
    with caplog.at_level("WARNING", logger="rlkit.logging"):
        mode = _log_two_steps(tmp_path / "run")
    elapsed = time.perf_counter() - start
    assert mode == "offline"
    assert "W&B: cannot reach the server" in caplog.text and "logging offline instead" in caplog.text
    assert elapsed < 20, elapsed  # was about 100 s before (wandb.init's 90 s timeout, then an abort)
    _check_written(tmp_path, tmp_path / "run")


@pytest.mark.slow
def test_server_that_accepts_but_never_answers_falls_back_offline(wandb_env, monkeypatch, tmp_path, caplog):
    """The reachability check passes (the port accepts connections), wandb.init then times out: the
    logger retries offline instead of aborting the run."""
    monkeypatch.setattr(rl_logging, "INIT_TIMEOUT_S", 3.0)
    with socket.socket() as server:  # accepts TCP connections (the kernel's backlog) and never replies
        server.bind(("127.0.0.1", 0))
        server.listen(64)
        monkeypatch.setenv("WANDB_BASE_URL", f"http://127.0.0.1:{server.getsockname()[1]}")
        start = time.perf_counter()
        with caplog.at_level("WARNING", logger="rlkit.logging"):
            mode = _log_two_steps(tmp_path / "run")
        elapsed = time.perf_counter() - start
    assert mode == "offline"  # the online init failed and the retry went offline
    assert elapsed < 30, elapsed
    _check_written(tmp_path, tmp_path / "run")
