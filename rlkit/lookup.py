"""Named-or-imported callables (reward functions, environments): one lookup rule for every registry.

Imports nothing heavy: reward worker processes load it.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable


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
