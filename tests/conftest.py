import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
# Shared test helpers (cfg_helpers.py, run_helpers.py) import by name from every test folder; the fixture modules
# of tests/fixtures/ (test reward functions, environments) by name from reward and environment worker processes,
# which inherit this sys.path (launched subprocesses get it through run_helpers.FIXTURES in PYTHONPATH).
for path in (HERE / "fixtures", HERE):
    if str(path) not in sys.path:
        sys.path.insert(0, str(path))


def pytest_collection_modifyitems(config, items):
    """`gpu`-marked tests need a CUDA device by nature (CUDA memory, NCCL, sleep mode): skipped without one."""
    import pytest
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(
        reason="needs a CUDA device (the gpu marker); scripts/gpu_check.py runs them there"
    )
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
