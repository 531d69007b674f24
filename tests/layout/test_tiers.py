"""The fast tier is decided by what a test starts, not by its folder: a test module whose tests start a trainer
run, a vLLM engine or processes of torch.distributed carries the `slow` marker (`pytestmark = pytest.mark.slow`,
or `@pytest.mark.slow` on each test that does), so `make test-fast` (`-m "not slow and not gpu"`) leaves it out
and runs every other test whatever its folder. Read from the source (nothing is imported)."""

from __future__ import annotations

import ast
from pathlib import Path

TESTS = Path(__file__).resolve().parents[1]
# Calls that start something the fast tier must not wait for: run_helpers' trainer runs and launches, a Trainer,
# a vLLM engine, torch.multiprocessing's process groups (directly or through learner_helpers.spawn_ranks).
RUN_HELPERS = {"train", "launch", "start", "one_and_two_processes", "run_args"}
STARTERS = {"Trainer", "VLLMEngine", "spawn_ranks"}
SPAWNERS = {"spawn", "start_processes"}  # torch.multiprocessing.spawn / start_processes, under any alias
# Modules where such a call starts nothing heavy, and why.
EXEMPT = {
    "rollout/test_vllm_gpu_paths.py": "a recorder stands in for vllm.LLM: VLLMEngine runs its set-up only",
}


def _marks(decorators, marker: str) -> bool:
    return any(marker in ast.unparse(d) for d in decorators)


def _module_marker(tree: ast.Module, marker: str) -> bool:
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(
            isinstance(t, ast.Name) and t.id == "pytestmark" for t in node.targets
        ):
            return marker in ast.unparse(node.value)
    return False


def _run_helper_names(tree: ast.Module) -> set[str]:
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module == "run_helpers":
            names |= {a.asname or a.name for a in node.names if a.name in RUN_HELPERS}
    return names


def _starts(call: ast.Call, helpers: set[str]) -> str | None:
    f = call.func
    if isinstance(f, ast.Name) and (f.id in helpers or f.id in STARTERS):
        return f.id
    if isinstance(f, ast.Attribute):
        owner = ast.unparse(f.value)
        if owner == "run_helpers" and f.attr in RUN_HELPERS:
            return f"run_helpers.{f.attr}"
        if f.attr in STARTERS:
            return f.attr
        if f.attr in SPAWNERS and owner in ("mp", "torch.multiprocessing", "multiprocessing"):
            return f"{owner}.{f.attr}"
    return None


def unmarked_starts(path: Path) -> list[str]:
    """`function: call` for every start of a trainer run, an engine or processes outside a slow-marked test."""
    tree = ast.parse(path.read_text())
    if _module_marker(tree, "slow") or _module_marker(tree, "gpu"):
        return []
    helpers = _run_helper_names(tree)
    found = []
    for node in ast.walk(tree):
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        test = node.name.startswith("test_")
        if test and (_marks(node.decorator_list, "slow") or _marks(node.decorator_list, "gpu")):
            continue
        for call in ast.walk(node):
            if isinstance(call, ast.Call) and (what := _starts(call, helpers)):
                # a helper or fixture that starts one: the module must be marked (its callers are not traced)
                found.append(f"{node.name}:{call.lineno} {what}")
    return found


def test_a_module_starting_a_run_an_engine_or_processes_is_marked_slow():
    modules = sorted(p for p in TESTS.rglob("test_*.py") if "fixtures" not in p.parts)
    assert len(modules) > 50
    unmarked = {}
    for path in modules:
        rel = path.relative_to(TESTS).as_posix()
        if rel in EXEMPT:
            continue
        if found := unmarked_starts(path):
            unmarked[rel] = found
    assert not unmarked, (
        "these tests start a trainer run, a vLLM engine or processes but are not marked slow "
        f"(add `pytestmark = pytest.mark.slow`, or @pytest.mark.slow on the test): {unmarked}"
    )


def test_the_scan_finds_an_unmarked_start(tmp_path):
    """The guard itself: an unmarked trainer run and an unmarked spawn are found; marked ones are not."""
    src = tmp_path / "test_x.py"
    src.write_text(
        "import pytest\nimport torch.multiprocessing as mp\nfrom run_helpers import train\n\n"
        "def test_a(tmp_path):\n    train(None, tmp_path)\n\n"
        "@pytest.mark.slow\ndef test_b(tmp_path):\n    train(None, tmp_path)\n\n"
        "def test_c():\n    mp.spawn(print, nprocs=2)\n"
    )
    assert unmarked_starts(src) == ["test_a:6 train", "test_c:13 mp.spawn"]
    src.write_text(
        src.read_text().replace("from run_helpers", "pytestmark = pytest.mark.slow\nfrom run_helpers")
    )
    assert unmarked_starts(src) == []


def test_the_unit_tests_of_every_folder_are_in_the_fast_tier():
    """The recorder tests of the loop (tests/trainer/test_sync.py, test_step.py) carry no slow marker."""
    for rel in ("trainer/test_sync.py", "trainer/test_learn.py"):
        tree = ast.parse((TESTS / rel).read_text())
        assert not _module_marker(tree, "slow"), rel
