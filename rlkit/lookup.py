"""Registries of names (one source for every name a config key can take) and named-or-imported callables
(reward functions, environments): one lookup rule for every registry.

Imports nothing heavy: reward worker processes load it.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Generic, TypeVar

T = TypeVar("T")


def lookup(spec: str, registry: dict[str, Callable], *, key: str, kind: str = "fn") -> Callable:
    """`registry[spec]`, else the object at import path `module:name` / `module.name`.

    Raises `ValueError` naming the config `key`, the value, the registered names and the path forms.
    """
    if spec in registry:
        return registry[spec]
    if ":" in spec:
        module, _, name = spec.partition(":")
    elif "." in spec:
        module, _, name = spec.rpartition(".")
    else:
        raise ValueError(
            f"{key}={spec!r} is not one of {list(registry)} and is not an import path "
            f"(module:{kind} or module.{kind})"
        )
    try:
        obj = getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError) as e:
        raise ValueError(f"{key}={spec!r}: cannot import {name!r} from {module!r} ({e})") from e
    if not callable(obj):
        raise ValueError(f"{key}={spec!r} is not callable")
    return obj


class Registry(dict[str, T], Generic[T]):
    """The one list of the names a config key can take, filled by the module that implements them; `T` is the
    type of what is registered (e.g. `Registry[AdvantageFn]`).

        ESTIMATORS: Registry[AdvantageFn] = Registry("algo.adv_estimator")

        @ESTIMATORS.register("grpo", group_based=True)
        def _grpo(inputs, params): ...

    `ESTIMATORS["grpo"]` is the registered object, `ESTIMATORS.props("grpo")` its properties, and
    `ESTIMATORS.check(value)` raises a `ValueError` that names the key, the value and every registered name.
    """

    def __init__(self, key: str):
        super().__init__()
        self.key = key
        self._props: dict[str, dict] = {}

    def register(self, name: str, **props) -> Callable[[T], T]:
        """Decorator: register the decorated object under `name` with keyword properties."""

        def add(obj: T) -> T:
            if name in self:
                raise ValueError(f"{self.key}: {name!r} is registered twice")
            self[name] = obj
            self._props[name] = props
            return obj

        return add

    def __delitem__(self, name: str) -> None:
        super().__delitem__(name)
        self._props.pop(name, None)

    def props(self, name: str) -> dict:
        self.check(name)
        return self._props[name]

    def names(self, **where) -> list[str]:
        """The registered names (those whose properties equal `where`)."""
        return [n for n in self if all(self._props[n].get(k) == v for k, v in where.items())]

    def check(self, value) -> None:
        if value not in self:
            raise ValueError(f"{self.key}={value!r} is not one of {list(self)}")

    def get_checked(self, value) -> T:
        self.check(value)
        return self[value]
