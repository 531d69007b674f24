"""The "Supported models" page is what the family matrix ran: docs/supported-models.md is rendered
from docs/supported-models.json (scripts/supported_models.py), which tests/rollout/test_families.py holds to
the outcome of every family; every family of tests/model_families.py has its row."""

import importlib.util
import json
from pathlib import Path

from model_families import FAMILIES

REPO = Path(__file__).resolve().parents[2]
spec = importlib.util.spec_from_file_location("supported_models", REPO / "scripts" / "supported_models.py")
supported_models = importlib.util.module_from_spec(spec)
spec.loader.exec_module(supported_models)


def test_the_page_is_rendered_from_the_matrix_results():
    data = json.loads(supported_models.DATA.read_text())
    assert set(data["families"]) == set(FAMILIES)
    assert supported_models.PAGE.read_text() == supported_models.render(data), (
        "docs/supported-models.md is out of date: run python scripts/supported_models.py"
    )


def test_every_family_has_a_row_with_its_outcome_on_both_engines():
    page = supported_models.PAGE.read_text()
    for name, (cls, _) in FAMILIES.items():
        (row,) = [line for line in page.splitlines() if line.startswith(f"| {name} |")]
        assert f"`{cls}`" in row and ("trains" in row or "refused" in row), row


def test_the_page_is_in_the_site_navigation():
    assert "supported-models.md" in (REPO / "mkdocs.yml").read_text()
