"""Every collective rlkit makes goes through rlkit/collectives.py, with the device its tensor must be on.

NCCL takes CUDA tensors only and gloo takes host tensors, so a CPU run cannot show a host tensor in a collective
(a reading of the CUDA paths found the learner's token counts were all-reduced from a host tensor; every 2+-GPU run would crash at the
end of step 1's update). Read from the source (nothing is imported): no raw torch.distributed collective and no
process-group method call outside the allowed module, and every call of rlkit's tensor collectives passes the
device as a variable (the learner's device), never a literal or a tensor's own `.device`. What
rlkit.collectives does with that device under NCCL is tested in tests/leaves/test_collectives.py.
"""

from __future__ import annotations

import ast
import os
from pathlib import Path

REPO = Path(os.environ.get("RLKIT_IMPORTS_ROOT", Path(__file__).resolve().parents[2]))
ALLOWED = {"rlkit/collectives.py"}
# torch.distributed's collectives and point-to-point calls (functions of the module).
COLLECTIVES = {
    "all_reduce", "all_gather", "all_gather_into_tensor", "all_gather_object", "all_to_all", "all_to_all_single",
    "broadcast", "broadcast_object_list", "scatter", "scatter_object_list", "gather", "gather_object", "reduce",
    "reduce_scatter", "reduce_scatter_tensor", "send", "recv", "isend", "irecv", "batch_isend_irecv", "barrier",
    "monitored_barrier", "all_reduce_coalesced", "send_object_list", "recv_object_list",
}  # fmt: skip
# Methods of a ProcessGroup / Backend object (the async weight bridge) that run a collective.
GROUP_METHODS = {"broadcast", "allreduce", "allgather", "reduce_scatter", "alltoall", "barrier", "all_reduce"}
# rlkit.collectives' tensor collectives -> the position of their device argument.
DEVICE_ARG = {"all_reduce": 2, "all_gather_cat": 2, "broadcast": 2}


def _dist_aliases(tree: ast.Module) -> tuple[set[str], dict[str, str]]:
    """Names bound to torch.distributed, and names imported from it (local name -> its name there)."""
    modules, functions = set(), {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.name == "torch.distributed":
                    modules.add(a.asname or "torch")
        elif isinstance(node, ast.ImportFrom) and node.module == "torch.distributed":
            for a in node.names:
                functions[a.asname or a.name] = a.name
        elif isinstance(node, ast.ImportFrom) and node.module == "torch":
            modules.update(a.asname or a.name for a in node.names if a.name == "distributed")
    return modules, functions


def _dotted(node: ast.AST) -> str:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        return f"{_dotted(node.value)}.{node.attr}"
    return "?"


def _collective_imports(tree: ast.Module) -> set[str]:
    """Local names bound to rlkit.collectives' tensor collectives."""
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module == "rlkit.collectives":
            names.update(a.asname or a.name for a in node.names if a.name in DEVICE_ARG)
    return names


def _device_arg(call: ast.Call, position: int) -> ast.AST | None:
    for k in call.keywords:
        if k.arg == "device":
            return k.value
    return call.args[position] if len(call.args) > position else None


def _bad_device(node: ast.AST | None) -> str | None:
    """Why `node` is not a device argument that names the learner's device, or None when it is."""
    if node is None:
        return "no device argument"
    if isinstance(node, ast.Constant):
        return f"a literal device {node.value!r}"
    if isinstance(node, ast.Name):
        return None
    if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "self":
        return None
    return f"device {ast.unparse(node)!r} (pass the learner's device: a variable or self.<attribute>)"


def violations(source: str, path: str) -> list[str]:
    """Every raw collective, and every rlkit collective without a proper device argument, in `source`."""
    if path in ALLOWED:
        return []
    tree = ast.parse(source)
    modules, functions = _dist_aliases(tree)
    ours = _collective_imports(tree)
    found = []
    for node in sorted((n for n in ast.walk(tree) if isinstance(n, ast.Call)), key=lambda n: n.lineno):
        if not isinstance(node, ast.Call):
            continue
        f, where = node.func, f"{path}:{node.lineno}"
        if isinstance(f, ast.Attribute):
            owner = _dotted(f.value)
            if f.attr in COLLECTIVES and (owner in modules or owner == "torch.distributed"):
                found.append(f"{where}: raw {owner}.{f.attr}")
            elif (
                f.attr in GROUP_METHODS and owner not in modules and not owner.startswith("self.accelerator")
            ):
                found.append(f"{where}: process-group method {owner}.{f.attr}")
        elif isinstance(f, ast.Name) and functions.get(f.id) in COLLECTIVES:
            found.append(f"{where}: raw torch.distributed.{functions[f.id]}")
        elif (
            isinstance(f, ast.Name)
            and f.id in ours
            and (why := _bad_device(_device_arg(node, DEVICE_ARG[f.id])))
        ):
            found.append(f"{where}: {f.id} with {why}")
    return found


def test_every_collective_goes_through_rlkit_collectives_with_the_learners_device():
    found = []
    for path in sorted((REPO / "rlkit").rglob("*.py")):
        rel = path.relative_to(REPO).as_posix()
        found += violations(path.read_text(), rel)
    assert not found, (
        "collectives outside rlkit/collectives.py or without the learner's device:\n" + "\n".join(found)
    )


def test_the_check_finds_each_kind():
    """The check can fail: each kind of call it must refuse, in a module of its own."""
    source = """
import torch
import torch.distributed as dist
from torch.distributed import all_gather as gather_all
from rlkit.collectives import all_reduce

def f(self, counts, x, pg, world):
    dist.all_reduce(torch.tensor(counts))                            # raw, on a host tensor
    torch.distributed.broadcast_object_list([x], src=0)              # raw, by its full name
    gather_all([x], x)                                               # raw, imported by name
    pg.broadcast(x, 0).wait()                                        # a process group's own method
    all_reduce(torch.tensor(counts), world)                          # no device: a host tensor stays there
    all_reduce(torch.tensor(counts), world, "cpu")                   # a literal device
    all_reduce(torch.tensor(counts), world, device=x.device)         # the tensor's own device
    all_reduce(torch.tensor(counts, device=self.device), world, self.device)  # right
    w.conn.send(None)                                                # a pipe, not a collective
"""
    found = violations(source, "rlkit/example.py")
    assert [line.split(": ", 1)[0] for line in found] == [f"rlkit/example.py:{n}" for n in range(8, 15)], (
        found
    )
    assert violations(source, "rlkit/collectives.py") == []
