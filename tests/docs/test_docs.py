"""The documentation stays complete: the generated config reference is current, and names every key and recipe."""

from __future__ import annotations

import importlib.util
from pathlib import Path

from rlkit.config.reference import field_docs

REPO = Path(__file__).resolve().parents[2]
DOCS = REPO / "docs"
CONFIG_PAGE = DOCS / "reference" / "config.md"

spec = importlib.util.spec_from_file_location("config_reference", REPO / "scripts" / "config_reference.py")
config_reference = importlib.util.module_from_spec(spec)
spec.loader.exec_module(config_reference)


def test_config_reference_is_current():
    assert CONFIG_PAGE.read_text() == config_reference.render(), (
        "docs/reference/config.md is out of date: run python scripts/config_reference.py"
    )


def test_every_config_key_is_in_the_config_reference():
    page = CONFIG_PAGE.read_text()
    missing = [key for key, _, _ in field_docs() if f"`{key}`" not in page]
    assert not missing, missing


def test_every_recipe_is_in_the_docs():
    text = "\n".join(p.read_text() for p in DOCS.rglob("*.md"))
    missing = [r.stem for r in (REPO / "recipes").glob("*.yaml") if f"+recipe={r.stem}" not in text]
    assert not missing, missing


def test_every_recipe_has_a_column_in_the_config_reference():
    header = next(
        line for line in CONFIG_PAGE.read_text().splitlines() if line.startswith("| key | no recipe")
    )
    for recipe in (REPO / "recipes").glob("*.yaml"):
        assert f" {recipe.stem} |" in header, recipe.stem


def test_every_docs_page_is_in_the_nav():
    nav = (REPO / "mkdocs.yml").read_text()
    pages = [p.relative_to(DOCS).as_posix() for p in DOCS.rglob("*.md")]
    assert pages and all(f" {page}" in nav for page in pages), [p for p in pages if f" {p}" not in nav]
