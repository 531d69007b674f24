"""`LocalRollouts` and `AsyncRollouts` implement the `Rollouts` protocol the trainer calls, with its signatures."""

import ast
import inspect
import textwrap

import pytest

from rlkit.rollout.local import LocalRollouts
from rlkit.rollout.protocol import Rollouts
from rlkit.rollout.remote.client import AsyncRollouts

METHODS = [n for n, v in vars(Rollouts).items() if callable(v) and not n.startswith("_")]


def test_the_protocol_names_the_calls_the_trainer_makes():
    assert sorted(METHODS) == sorted(
        ["start", "produce", "push", "evaluate", "checkpoint", "load_checkpoint", "close"]
    )


@pytest.mark.parametrize("impl", [LocalRollouts, AsyncRollouts])
@pytest.mark.parametrize("name", METHODS)
def test_each_side_has_the_method_with_the_protocols_parameters(impl, name):
    want = inspect.signature(getattr(Rollouts, name)).parameters
    got = inspect.signature(getattr(impl, name)).parameters
    assert [(p.name, p.kind) for p in got.values()] == [(p.name, p.kind) for p in want.values()]
    assert [p.default for p in got.values()] == [p.default for p in want.values()]


def _assigned_in_init(cls) -> set[str]:
    tree = ast.parse(textwrap.dedent(inspect.getsource(cls.__init__)))
    targets = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Assign):
            for t in node.targets:
                targets += t.elts if isinstance(t, ast.Tuple) else [t]
        elif isinstance(node, ast.AnnAssign):
            targets.append(node.target)
    return {
        t.attr for t in targets if isinstance(t, ast.Attribute) and getattr(t.value, "id", None) == "self"
    }


@pytest.mark.parametrize("impl", [LocalRollouts, AsyncRollouts])
def test_each_side_has_the_protocols_attributes(impl):
    for attr in Rollouts.__annotations__:
        assert attr in _assigned_in_init(impl) or isinstance(getattr(impl, attr, None), property), attr
