"""The config's reference: every key of rlkit/config/schema.py with its default and the docstring written
under it (scripts/config_reference.py builds the docs' table from it; tests/docs/test_readme.py and
test_docs.py check that every key is documented)."""

import ast
import dataclasses as dc
import inspect

from rlkit.config import schema


def field_docs() -> list[tuple[str, object, str]]:
    """(dotted key, default, one-line doc) of every config field, read from the field docstrings of
    rlkit/config/schema.py (they are not kept at run time). Feeds docs/reference/config.md and its tests."""
    tree = ast.parse(inspect.getsource(schema))
    docs: dict[str, dict[str, str]] = {}
    for node in tree.body:
        if isinstance(node, ast.ClassDef):
            body = node.body
            for a, b in zip(body, body[1:]):
                if (
                    isinstance(a, ast.AnnAssign)
                    and isinstance(b, ast.Expr)
                    and isinstance(b.value, ast.Constant)
                ):
                    docs.setdefault(node.name, {})[a.target.id] = " ".join(str(b.value.value).split())

    def dataclass_of(annotation):  # the annotations are strings (`from __future__ import annotations`)
        cls = getattr(schema, annotation, None) if isinstance(annotation, str) else annotation
        return cls if dc.is_dataclass(cls) else None

    out = []

    def walk(cls, prefix):
        for f in dc.fields(cls):
            sub = dataclass_of(f.type)
            if sub is not None:
                walk(sub, f"{prefix}{f.name}.")
                continue
            default = f.default if f.default is not dc.MISSING else f.default_factory()
            out.append((f"{prefix}{f.name}", default, docs.get(cls.__name__, {}).get(f.name, "")))

    walk(schema.RLConfig, "")
    return out
