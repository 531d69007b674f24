import gc
import sys
from pathlib import Path

import pytest

# Collection imports every test module, and with them torch, transformers and vLLM: without the collector's
# automatic passes (each full one rescans the growing heap) a worker collects in ~18 s instead of ~24 s on 2 cores;
# what the imports made is then frozen, out of later collections' way (pytest_collection_finish). As
# rlkit/gcpolicy.py does for a trainer's set-up.
gc.disable()

HERE = Path(__file__).resolve().parent
# Shared test helpers (cfg_helpers.py, run_helpers.py) import by name from every test folder; the fixture modules
# of tests/fixtures/ (test reward functions, environments) by name from reward and environment worker processes,
# which inherit this sys.path (launched subprocesses get it through run_helpers.FIXTURES in PYTHONPATH).
for path in (HERE / "fixtures", HERE):
    if str(path) not in sys.path:
        sys.path.insert(0, str(path))


# The heaviest modules, run first: `make test` hands whole modules to its 2 workers in collection order
# (pytest-xdist's --dist loadfile with --no-loadscope-reorder; by default xdist puts the modules with the most
# tests first, which left the long trainer and vLLM modules, of few tests each, running alone at the end while
# the other worker idled); longest first, the workers end together. The order comes from a whole-suite run's
# --durations on 2 cores; each module's seconds are in benchmarks/ (the test-suite timings).
HEAVIEST = (
    "trainer/test_async.py",
    "rollout/test_families.py",
    "rollout/test_vllm_train.py",
    "trainer/test_distill.py",
    "trainer/test_e2e.py",
    "trainer/test_async_inflight.py",
    "envs/test_multiturn.py",
    "scripts/test_bench.py",
    "trainer/test_families_train.py",
    "trainer/test_dynamic.py",
    "envs/test_ecosystem_envs.py",
    "rollout/test_vllm_engine.py",
    "trainer/test_operations.py",
    "learner/test_fsdp2.py",
    "trainer/test_stopped_rank.py",
    "trainer/test_reliability.py",
)


def pytest_collection_modifyitems(config, items):
    """Runs the `HEAVIEST` modules first; `gpu`-marked tests need a CUDA device by nature (CUDA memory, NCCL,
    sleep mode): skipped without one. (`slow` is set in each module, by what its tests start: a trainer run,
    a vLLM engine, a second process, or seconds of training; `make test-fast` leaves those out.
    tests/layout/test_tiers.py holds that a module starting a trainer run or an engine is marked.)"""
    import pytest
    import torch

    module = {id(item): Path(item.fspath).relative_to(HERE).as_posix() for item in items}

    def rank(item) -> int:  # a stable sort: the order within a module and among the others is kept
        path = module[id(item)]
        return HEAVIEST.index(path) if path in HEAVIEST else len(HEAVIEST)

    items.sort(key=rank)
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(
        reason="needs a CUDA device (the gpu marker); scripts/gpu_check.py runs them there"
    )
    for item in items:
        # The marker itself, not `item.keywords`: those hold every parent folder's name too, so a checkout in a
        # folder named gpu (/work/wt/gpu, ~/gpu/rlkit) would skip the whole suite.
        if item.get_closest_marker("gpu") is not None:
            item.add_marker(skip)


def pytest_configure(config):
    """pytest-xdist's controller (`-n 2`) collects nothing: its collector goes back on at once."""
    if not hasattr(config, "workerinput") and getattr(config.option, "numprocesses", None):
        gc.enable()


def pytest_collection_finish(session):
    """The collector back on after the imports of collection (see the top of this file)."""
    gc.freeze()
    gc.enable()


def pytest_unconfigure(config):
    """Frozen objects are never freed, not even at exit (nanobind's extensions then report leaks): unfrozen."""
    gc.unfreeze()


@pytest.fixture(scope="session")
def tiny_ckpt(tmp_path_factory) -> str:
    """A random tiny Llama (hidden 64, 2 layers) with the real SmolLM2 tokenizer, one per session (the rollout
    and model tests)."""
    from rlkit.models import make_tiny_checkpoint

    return make_tiny_checkpoint(tmp_path_factory.mktemp("tiny"), seed=0)


@pytest.fixture(scope="session")
def tiny_tokenizer(tiny_ckpt):
    from rlkit.models import load_tokenizer

    return load_tokenizer(tiny_ckpt)
