"""One table of exit codes: every code means one thing, the modules use the table, the README lists it."""

from __future__ import annotations

import re
from pathlib import Path

from bigmoe import exit_codes
from bigmoe.cli.plan import EXIT_REFUSED
from bigmoe.model import fetch
from bigmoe.run import PlanRefused

README = Path(__file__).resolve().parents[2] / "README.md"


def constants() -> dict[str, int]:
    return {k: v for k, v in vars(exit_codes).items() if k.isupper() and isinstance(v, int)}


def test_each_code_means_one_thing():
    codes = constants()
    assert len(set(codes.values())) == len(codes), codes
    assert [code for code, _ in exit_codes.TABLE] == sorted(codes.values())


def test_plan_refused_and_no_disk_space_differ_everywhere():
    assert PlanRefused.exit_code == EXIT_REFUSED == exit_codes.PLAN_REFUSED
    assert fetch.DiskTooSmall.exit_code == fetch.EXIT_NO_SPACE == exit_codes.NO_SPACE != exit_codes.PLAN_REFUSED


def test_the_readme_lists_the_table():
    section = README.read_text().split("## Exit codes", 1)[1].split("\n## ", 1)[0]
    listed = [int(m) for m in re.findall(r"^\| (\d+) \|", section, re.M)]
    assert listed == [code for code, _ in exit_codes.TABLE]
