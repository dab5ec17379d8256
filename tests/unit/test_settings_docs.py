"""The README's table of variables and docs/settings.md name exactly the settings the plugin reads, in one order."""

from __future__ import annotations

import re
from pathlib import Path

from bigmoe_pager.settings import variable_names

ROOT = Path(__file__).resolve().parents[2]


def readme_rows() -> list[str]:
    return re.findall(r"^\| `(BIGMOE_[A-Z0-9_]+)` \|", (ROOT / "README.md").read_text(), re.M)


def settings_sections() -> list[str]:
    return re.findall(r"^## `(BIGMOE_[A-Z0-9_]+)`$", (ROOT / "docs" / "settings.md").read_text(), re.M)


def test_the_readme_has_one_row_for_each_setting():
    rows = readme_rows()
    assert len(rows) == len(set(rows))
    assert set(rows) == set(variable_names())


def test_docs_settings_has_one_section_for_each_readme_row_in_its_order():
    assert settings_sections() == readme_rows()


def test_each_link_from_the_readme_into_docs_settings_names_a_section():
    anchors = {name.lower() for name in settings_sections()} | {"what-has-run-where-in-full"}
    links = re.findall(r"docs/settings\.md#([a-z0-9_-]+)", (ROOT / "README.md").read_text())
    assert links and set(links) <= anchors
