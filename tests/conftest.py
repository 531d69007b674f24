import gc
import sys
from pathlib import Path

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


# The tests marked `slow` (`make test-fast` leaves them out; `make test`, CI, runs them): every run of the whole
# trainer (tests/trainer), and the modules that build a vLLM engine, start a second process or train a model for
# seconds. Over ~10 s a module on 2 cores; what stays is the edit loop's tier, under 2 minutes.
SLOW = (
    "trainer/",
    "rollout/test_families.py", "rollout/test_vllm_engine.py", "rollout/test_vllm_inflight.py",
    "rollout/test_vllm_moe_push.py", "rollout/test_vllm_train.py", "rollout/test_vllm_adapter.py",
    "rollout/test_async_bridge.py", "rollout/test_hf_engine.py", "rollout/test_models.py",
    "envs/test_multiturn.py", "envs/test_ecosystem_envs.py", "envs/test_containment.py", "envs/test_episodes.py",
    "envs/test_shared_memory.py",
    "config/test_config.py", "config/test_teacher_checks.py",
    "learner/test_compiled.py", "learner/test_fsdp2.py", "learner/test_fsdp2_moe.py", "learner/test_distributed.py",
    "learner/test_learner.py",
    "rewards/test_correct.py", "rewards/test_reward_model.py", "rewards/test_reward_contract.py",
    "rewards/test_reward_workers.py", "rewards/test_cgroup_trust.py",
    "data/test_reasoning_gym.py",
    "eval/test_eval.py",
    "misc/test_bench.py", "misc/test_wheel.py", "misc/test_gpu_check.py", "misc/test_step_in_40_lines.py",
)  # fmt: skip


# The heaviest modules, run first: `make test` hands whole modules to its 2 workers in collection order
# (pytest-xdist's --dist loadfile with --no-loadscope-reorder; by default xdist puts the modules with the most
# tests first, which left the long trainer and vLLM modules, of few tests each, running alone at the end while
# the other worker idled); longest first, the workers end together. Each module's seconds in a whole-suite run
# on 2 cores (2026-11-27, session 17, from --durations), longest first.
HEAVIEST = (
    "trainer/test_async.py",  # 287
    "rollout/test_families.py",  # 233
    "rollout/test_vllm_train.py",  # 211
    "trainer/test_distill.py",  # 146
    "trainer/test_e2e.py",  # 131
    "trainer/test_async_inflight.py",  # 130
    "envs/test_multiturn.py",  # 124
    "misc/test_bench.py",  # 124
    "trainer/test_families_train.py",  # 101
    "trainer/test_dynamic.py",  # 94
    "envs/test_ecosystem_envs.py",  # 82
    "rollout/test_vllm_engine.py",  # 78
    "trainer/test_operations.py",  # 60
    "learner/test_fsdp2.py",  # 57
    "trainer/test_stopped_rank.py",  # 57
    "trainer/test_reliability.py",  # 40
)


def pytest_collection_modifyitems(config, items):
    """Runs the `HEAVIEST` modules first; marks the `SLOW` tests; `gpu`-marked tests need a CUDA device by
    nature (CUDA memory, NCCL, sleep mode): skipped without one."""
    import pytest
    import torch

    module = {id(item): Path(item.fspath).relative_to(HERE).as_posix() for item in items}

    def rank(item) -> int:  # a stable sort: the order within a module and among the others is kept
        path = module[id(item)]
        return HEAVIEST.index(path) if path in HEAVIEST else len(HEAVIEST)

    items.sort(key=rank)
    for item in items:
        if module[id(item)].startswith(SLOW):
            item.add_marker(pytest.mark.slow)
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(
        reason="needs a CUDA device (the gpu marker); scripts/gpu_check.py runs them there"
    )
    for item in items:
        if "gpu" in item.keywords:
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
