"""prepare: the paging file is built when the plan needs one, reused while it matches,
rebuilt when it does not, and a build that dies leaves nothing that looks valid."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from bigmoe.prepare import paging_file_matches, prepare
from bigmoe.tinymoe.shape import TinyShape


@pytest.fixture
def model(tiny_checkpoint):
    return tiny_checkpoint(TinyShape(layers=2, experts=4, top_k=2, hidden=128, moe_intermediate=128, vocab=512), "fp8",
                           seed=2, with_tokenizer=False)


def plan_for(path, compress: bool, source: str = "paging file"):
    """The fields of bigmoe.plan.Plan that prepare reads (a stand-in, not the estimator)."""
    return SimpleNamespace(ssd_source=source, paging_file=str(path), compress=compress)


def test_not_needed_without_a_paging_file(model, tmp_path):
    assert prepare(plan_for(tmp_path / "x.pages", False, source="checkpoint"), model) is None
    assert not (tmp_path / "x.pages").exists()


@pytest.mark.parametrize("compress", [False, True])
def test_built_then_reused_then_rebuilt_when_it_no_longer_matches(model, tmp_path, compress):
    path = tmp_path / "m.pages"
    events = []
    assert prepare(plan_for(path, compress), model, lambda e, f: events.append(f["state"])) == path
    assert events[0] == "building" and events[-1] == "built"
    first = path.stat().st_mtime_ns
    events.clear()
    prepare(plan_for(path, compress), model, lambda e, f: events.append(f["state"]))
    assert events == ["reused"] and path.stat().st_mtime_ns == first
    events.clear()
    prepare(plan_for(path, not compress), model, lambda e, f: events.append(f["state"]))
    assert events[-1] == "built" and paging_file_matches(path, model, not compress)
    assert not paging_file_matches(path, model, compress)


def test_a_build_that_dies_leaves_nothing_valid(model, tmp_path):
    path = tmp_path / "m.pages"

    def die(event, fields):
        if fields.get("records_done", 0) >= 3:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        prepare(plan_for(path, True), model, die)
    assert not path.exists()
    assert not paging_file_matches(path, model, True)
    assert [p.name for p in tmp_path.iterdir()] == []


def test_a_truncated_file_is_rebuilt(model, tmp_path):
    path = tmp_path / "m.pages"
    prepare(plan_for(path, False), model)
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])
    assert not paging_file_matches(path, model, False)
    events = []
    prepare(plan_for(path, False), model, lambda e, f: events.append(f["state"]))
    assert events[-1] == "built" and paging_file_matches(path, model, False)
