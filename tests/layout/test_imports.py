"""The layered layout of rlkit (the table below, also in docs/concepts/training-step.md), read from every `import` of
rlkit/ (nothing is imported).

    0 leaves     batch, algos, config/schema, config/derived, config/reference, weights, digests, rundir, checkpoints,
                 collectives, timing, metrics, logging, plots, models, model_files, vision, vlmodels, verify, lookup, flops,
                 gcpolicy, sandbox
    1 inputs     config/rules, data, rewards, envs
    2 machines   learner/, rollout/engines/
    3 rollout    rollout/ (protocol, episodes, producer, local, scored, remote/)
    4 loop       learn, sync, trainer (trainer -> learn, sync sideways)
    5 entry      train, eval, sft

An import points to the same or a lower layer; there is no circle; learner/ and rollout/ never import each
other; a `_private` name never crosses a module border; an import inside a function only defers a heavy
third-party package (the imported module brings one that the importing module does not have yet).
"""

from __future__ import annotations

import ast
import os
import sys
from pathlib import Path

import pytest

REPO = Path(os.environ.get("RLKIT_IMPORTS_ROOT", Path(__file__).resolve().parents[2]))
PACKAGE = REPO / "rlkit"
LEAVES = {
    "rlkit", "rlkit.batch", "rlkit.algos", "rlkit.config", "rlkit.config.schema", "rlkit.config.derived",
    "rlkit.config.reference", "rlkit.weights", "rlkit.digests", "rlkit.rundir", "rlkit.checkpoints",
    "rlkit.collectives", "rlkit.timing", "rlkit.metrics", "rlkit.logging", "rlkit.plots", "rlkit.models",
    "rlkit.lookup", "rlkit.flops", "rlkit.gcpolicy", "rlkit.vlmodels", "rlkit.vision", "rlkit.model_files", "rlkit.verify",
}  # fmt: skip
HEAVY = {
    "torch",
    "transformers",
    "accelerate",
    "vllm",
    "peft",
    "matplotlib",
    "datasets",
    "math_verify",
    "sympy",
    "reasoning_gym",  # optional extras, imported only when used
    "verifiers",
    "openenv",
}


def layer(module: str) -> int:
    if module in ("rlkit.train", "rlkit.eval", "rlkit.sft"):
        return 5
    if module in ("rlkit.trainer", "rlkit.learn", "rlkit.sync"):
        return 4
    if module.startswith(("rlkit.learner", "rlkit.rollout.engines")):
        return 2
    if module.startswith("rlkit.rollout"):
        return 3
    if module == "rlkit.config.rules" or module.startswith(("rlkit.data", "rlkit.rewards", "rlkit.envs")):
        return 1
    if module in LEAVES or module.startswith(("rlkit.algos.", "rlkit.sandbox")):
        return 0
    raise AssertionError(
        f"{module} has no layer: add it to the table of docs/concepts/training-step.md and of this test"
    )


def module_name(path: Path) -> str:
    parts = list(path.relative_to(REPO).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


MODULES = {module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def resolve(name: str) -> str:
    """The rlkit module an import names (`from rlkit.x import y` may name module rlkit.x.y)."""
    while name not in MODULES and "." in name:
        name = name.rpartition(".")[0]
    return name


class Import:
    def __init__(self, source, target, names, line, in_function):
        self.source, self.target, self.names, self.line, self.in_function = (
            source,
            target,
            names,
            line,
            in_function,
        )

    def __repr__(self):
        return f"{MODULES[self.source].relative_to(REPO)}:{self.line} imports {self.target}"


def imports_of(module: str) -> list[Import]:
    tree = ast.parse(MODULES[module].read_text())
    out = []

    def visit(node, in_function):
        for child in ast.iter_child_nodes(node):
            fn = in_function or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef))
            if isinstance(child, ast.Import):
                for a in child.names:
                    out.append(Import(module, a.name, [], child.lineno, in_function))
            elif isinstance(child, ast.ImportFrom) and child.level == 0 and child.module:
                names = [a.name for a in child.names]
                if child.module.startswith("rlkit"):
                    for n in names:  # `from rlkit.x import y` where y is a module
                        full = f"{child.module}.{n}"
                        target = full if full in MODULES else child.module
                        out.append(
                            Import(
                                module,
                                target,
                                [n] if target == child.module else [],
                                child.lineno,
                                in_function,
                            )
                        )
                else:
                    out.append(Import(module, child.module, names, child.lineno, in_function))
            visit(child, fn)

    visit(tree, False)
    return out


IMPORTS = {m: imports_of(m) for m in MODULES}


def internal(imp: Import) -> bool:
    return imp.target == "rlkit" or imp.target.startswith("rlkit.")


def test_every_module_has_a_layer():
    for module in MODULES:
        layer(module)


def test_no_import_points_upward():
    bad = [
        f"{imp} (layer {layer(imp.source)} -> {layer(resolve(imp.target))})"
        for imps in IMPORTS.values()
        for imp in imps
        if internal(imp) and layer(resolve(imp.target)) > layer(imp.source)
    ]
    assert not bad, "upward imports:\n" + "\n".join(bad)


def test_learner_and_rollout_never_import_each_other():
    def side(m):
        return (
            "learner"
            if m.startswith("rlkit.learner")
            else "rollout"
            if m.startswith("rlkit.rollout")
            else None
        )

    bad = [
        repr(imp)
        for imps in IMPORTS.values()
        for imp in imps
        if internal(imp) and {side(imp.source), side(resolve(imp.target))} == {"learner", "rollout"}
    ]
    assert not bad, "learner/ and rollout/ meet only in rlkit.batch and rlkit.weights:\n" + "\n".join(bad)


def _graph(include_deferred: bool) -> dict[str, set[str]]:
    graph = {m: set() for m in MODULES}
    for m, imps in IMPORTS.items():
        for imp in imps:
            if internal(imp) and (include_deferred or not imp.in_function):
                target = resolve(imp.target)
                # A package's __init__ runs before any of its modules: importing rlkit.a.b imports rlkit.a.
                parents = [".".join(target.split(".")[:i]) for i in range(2, target.count(".") + 1)]
                for t in [*parents, target]:
                    if t != m and t in MODULES and not m.startswith(t + "."):
                        graph[m].add(t)
    return graph


def test_no_import_circle():
    graph = _graph(include_deferred=True)
    state: dict[str, int] = {}
    cycles = []

    def dfs(node, path):
        state[node] = 1
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                cycles.append(" -> ".join(path[path.index(nxt) :] + [nxt]))
            elif nxt not in state:
                dfs(nxt, path + [nxt])
        state[node] = 2

    for m in sorted(graph):
        if m not in state:
            dfs(m, [m])
    assert not cycles, "import circles:\n" + "\n".join(cycles)


def test_no_private_name_crosses_a_module_border():
    bad = []
    for imps in IMPORTS.values():
        for imp in imps:
            if not internal(imp):
                continue
            private = [n for n in imp.names if n.startswith("_") and not n.startswith("__")]
            if private or any(part.startswith("_") and part != "__init__" for part in imp.target.split(".")):
                bad.append(f"{imp}: {private or imp.target}")
    for path in MODULES.values():  # `module._name` on an imported rlkit module
        aliases = {}
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if (
                isinstance(node, ast.ImportFrom)
                and node.module
                and node.module.startswith("rlkit")
                and not node.level
            ):
                for a in node.names:
                    if f"{node.module}.{a.name}" in MODULES:
                        aliases[a.asname or a.name] = f"{node.module}.{a.name}"
            elif isinstance(node, ast.Import):
                for a in node.names:
                    if a.name.startswith("rlkit") and a.asname:
                        aliases[a.asname] = a.name
        for node in ast.walk(tree):
            if (
                isinstance(node, ast.Attribute)
                and isinstance(node.value, ast.Name)
                and node.value.id in aliases
                and node.attr.startswith("_")
                and not node.attr.startswith("__")
            ):
                bad.append(f"{path.relative_to(REPO)}:{node.lineno}: {node.value.id}.{node.attr}")
    assert not bad, "private names used across modules:\n" + "\n".join(bad)


def _heavy_closure() -> dict[str, set[str]]:
    """The heavy third-party packages each module brings at import time (its top-level imports, transitively)."""
    graph = _graph(include_deferred=False)
    own = {
        m: {imp.target.split(".")[0] for imp in imps if not imp.in_function and not internal(imp)} & HEAVY
        for m, imps in IMPORTS.items()
    }
    closure: dict[str, set[str]] = {}

    def heavy(m, seen=()):
        if m in closure:
            return closure[m]
        out = set(own[m])
        for t in graph[m]:
            if t not in seen:
                out |= heavy(t, (*seen, m))
        closure[m] = out
        return out

    for m in MODULES:
        heavy(m)
    return closure


def test_an_import_inside_a_function_only_defers_a_heavy_package():
    heavy = _heavy_closure()
    bad = [
        f"{imp} (brings nothing heavy that {imp.source} lacks)"
        for imps in IMPORTS.values()
        for imp in imps
        if internal(imp) and imp.in_function and not (heavy[resolve(imp.target)] - heavy[imp.source])
    ]
    assert not bad, "move these imports to the top of the module:\n" + "\n".join(bad)


def test_the_entry_point_imports_nothing_heavy():
    """multiprocessing's spawned children of `python -m rlkit.train` (reward, rollout, environment workers) import
    rlkit.train first, as their `__mp_main__`: a reward worker that imported torch for it started in ~5 s, not
    ~1. Statically (top-level imports, transitively) and in a fresh interpreter."""
    import subprocess

    assert not _heavy_closure()["rlkit.train"]
    code = "import sys, rlkit.train; print(' '.join(sorted({m.split('.')[0] for m in sys.modules})))"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert not HEAVY & set(proc.stdout.split()), HEAVY & set(proc.stdout.split())


@pytest.mark.parametrize("path", sorted(MODULES.values()), ids=lambda p: str(p.relative_to(REPO)))
def test_every_module_says_what_it_owns(path):
    tree = ast.parse(path.read_text())
    assert ast.get_docstring(tree), f"{path.relative_to(REPO)} has no module docstring"


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q"]))
