"""The README stays true: every config key is documented, and its two set-up commands exist."""

from __future__ import annotations

import re
from pathlib import Path

from rlkit.config.schema import field_docs

REPO = Path(__file__).resolve().parents[2]
README = (REPO / "README.md").read_text()


def test_every_config_key_is_in_the_readme():
    missing = [key for key, _, _ in field_docs() if f"`{key}`" not in README]
    assert not missing, f"README.md lacks these config keys (run scripts/config_table.py): {missing}"


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
