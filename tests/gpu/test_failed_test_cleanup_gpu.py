"""One failed GPU test must not fail the tests after it (run 41: one failure, then 16 more).

An inner pytest session runs two tests: the first fails on purpose while its frames hold a captured CUDA graph in a
reference cycle; the second captures a graph and collects garbage inside the capture, as Python may at any
allocation. With this folder's conftest the second passes; without it the same session shows the harm the conftest
prevents, so this test can tell the two apart.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

pytestmark = pytest.mark.gpu

INNER_TESTS = """
import gc

import torch


class Cycle:
    def __init__(self):
        self.me = self  # only the collector frees it, as it frees a failed pager's objects


def test_fails_holding_a_graph():
    held = Cycle()
    held.x = torch.zeros(16, device="cuda")
    torch.cuda.synchronize()
    held.graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(held.graph):
        held.x.add_(1)
    assert held is None, "fails on purpose"


def test_captures_with_a_collection_inside():
    x = torch.zeros(16, device="cuda")
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        x.add_(1)
        gc.collect()
        x.add_(1)
    graph.replay()
    torch.cuda.synchronize()
    assert bool((x == 2).all())
"""


def inner_outcomes(folder: Path) -> dict[str, str]:
    """Each inner test's outcome ("passed" or "failed") from a fresh interpreter's pytest run in `folder`."""
    (folder / "pytest.ini").write_text("[pytest]\n")
    (folder / "test_inner.py").write_text(INNER_TESTS)
    report = folder / "report.xml"
    run = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", f"--junitxml={report}", str(folder)],
        cwd=folder,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert report.exists(), run.stdout + run.stderr
    outcomes = {}
    for case in ET.parse(report).getroot().iter("testcase"):
        bad = case.find("failure") is not None or case.find("error") is not None
        outcomes[case.get("name")] = "failed" if bad else "passed"
    return outcomes


def test_a_failed_test_does_not_void_the_next_tests_capture(tmp_path):
    shutil.copy(Path(__file__).with_name("conftest.py"), tmp_path / "conftest.py")
    assert inner_outcomes(tmp_path) == {
        "test_fails_holding_a_graph": "failed",
        "test_captures_with_a_collection_inside": "passed",
    }


def test_without_the_conftest_the_failed_tests_graph_dies_inside_the_next_capture(tmp_path):
    assert inner_outcomes(tmp_path) == {
        "test_fails_holding_a_graph": "failed",
        "test_captures_with_a_collection_inside": "failed",
    }
