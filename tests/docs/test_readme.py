"""The README stays true: its two set-up commands exist and it names every recipe. (Every config key is
documented in docs/reference/config.md, generated from the schema: tests/docs/test_docs.py.)"""

from __future__ import annotations

import re
from pathlib import Path

from rlkit.config.reference import field_docs

REPO = Path(__file__).resolve().parents[2]
README = (REPO / "README.md").read_text()


def test_every_config_key_is_in_the_config_reference():
    page = (REPO / "docs" / "reference" / "config.md").read_text()
    missing = [key for key, _, _ in field_docs() if f"`{key}`" not in page]
    assert not missing, (
        f"docs/reference/config.md lacks these keys (run scripts/config_reference.py): {missing}"
    )


def test_every_config_key_has_a_doc_line():
    assert all(doc for _, _, doc in field_docs())


def test_the_two_setup_commands_are_make_targets():
    makefile = (REPO / "Makefile").read_text()
    for target in ("quickstart", "test"):
        assert f"make {target}" in README
        assert re.search(rf"^{target}:", makefile, re.M), target
    assert "make test" in (REPO / ".ci" / "run").read_text()


def test_every_recipe_is_in_the_readme():
    for recipe in (REPO / "recipes").glob("*.yaml"):
        assert f"+recipe={recipe.stem}" in README, recipe.stem
