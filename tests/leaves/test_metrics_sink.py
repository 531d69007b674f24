"""The metrics sinks on a full disk and with a broken W&B (rlkit/logging.py): metrics.jsonl's write error names the
file; W&B's failures never end a run; a wandb that does not import stops the run at start-up."""

import errno
import json
import logging
import sys

import pytest

from rlkit.config.schema import ConfigError
from rlkit.logging import MetricsLogger
from rlkit.train import compose, load_config


def test_a_failed_metrics_write_names_the_file(tmp_path):
    """Before: a bare `OSError: [Errno 28] No space left on device` with no file named."""
    logger = MetricsLogger("none", tmp_path, {})
    logger._jsonl.close()
    logger._jsonl = open("/dev/full", "a")  # every write: ENOSPC, as on a full disk
    with pytest.raises(OSError) as raised:
        logger.log({"loss": 1.0}, step=1)
    assert raised.value.errno == errno.ENOSPC
    assert str(tmp_path / "metrics.jsonl") in str(raised.value)
    logger._jsonl = open(tmp_path / "metrics.jsonl", "a")
    logger.close()


class _FullDiskRun:
    """A W&B run whose every call fails as wandb's do when its folder's disk is full."""

    id = "x"

    def __init__(self):
        self.calls = 0

    def log(self, *args, **kwargs):
        self.calls += 1
        raise OSError(errno.ENOSPC, "No space left on device")

    def finish(self):
        self.calls += 1
        raise OSError(errno.ENOSPC, "No space left on device")


def test_wandb_failing_on_a_full_disk_never_ends_a_finished_run(tmp_path, caplog):
    """Before: `run.finish()` raised out of the trainer's close and a finished run exited 1."""
    logger = MetricsLogger("none", tmp_path, {})
    logger.run = run = _FullDiskRun()
    with caplog.at_level(logging.WARNING, logger="rlkit.logging"):
        for step in (1, 2, 3):
            logger.log({"loss": float(step)}, step=step)
        logger.close()
    assert run.calls == 4  # every call was tried: three logs and the finish
    lines = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [line["step"] for line in lines] == [1, 2, 3]
    warned = [r.getMessage() for r in caplog.records if r.getMessage().startswith("W&B:")]
    assert len(warned) == 2, warned  # once for run.log, once for run.finish
    assert "run.log failed (OSError" in warned[0] and "run.finish failed" in warned[1]


def test_a_wandb_that_does_not_import_stops_the_run_at_start_up(tmp_path, monkeypatch):
    """Before: the preflight passed and `import wandb` failed in the logger, after the model had loaded."""
    monkeypatch.setitem(sys.modules, "wandb", None)  # `import wandb` raises ImportError
    cfg = compose(
        ["model.path=smollm2-135m", "data=arithmetic", "logger=wandb", f"trainer.run_dir={tmp_path}/r"]
    )
    with pytest.raises(
        ConfigError, match=r"logger.backend='wandb' but wandb does not import \(ModuleNotFoundError"
    ):
        load_config(cfg)
