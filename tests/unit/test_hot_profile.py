"""Hot-expert profiles: counted from traces, saved atomically, refused when damaged or foreign."""

from __future__ import annotations

import numpy as np
import pytest
from bigmoe_pager.core.hot_profile import HotProfile, ProfileError


@pytest.fixture
def profile() -> HotProfile:
    trace = np.array(
        [[[1, 2], [0, -1]], [[2, 3], [0, 1]], [[2, 1], [3, 0]]], dtype=np.int32
    )  # [3 tokens, 2 layers, k=2]
    return HotProfile.from_trace(trace, num_experts=4)


def test_counts_and_order(profile):
    assert profile.counts.tolist() == [[0, 2, 3, 1], [3, 1, 0, 1]]
    assert profile.hottest(0).tolist() == [2, 1, 3, 0]
    assert profile.hottest(1, 3).tolist() == [0, 1, 3]  # tie 1 vs 3 -> lower id first


def test_round_trip(tmp_path, profile):
    path = tmp_path / "hot.npz"
    profile.save(path)
    back = HotProfile.load(path, num_layers=2, num_experts=4)
    assert np.array_equal(back.counts, profile.counts)
    assert [p.name for p in tmp_path.iterdir()] == ["hot.npz"]  # no temp file left behind


@pytest.mark.parametrize(
    "damage",
    [
        lambda p: p.write_bytes(p.read_bytes()[: len(p.read_bytes()) // 2]),
        lambda p: p.write_bytes(b"not a profile"),
        lambda p: p.unlink(),
        lambda p: np.savez(p.open("wb"), version=np.int64(99), counts=np.zeros((2, 4), np.int64)),
        lambda p: np.savez(p.open("wb"), version=np.int64(1), counts=np.zeros((2, 4), np.float32)),
    ],
)
def test_damaged_profiles_are_refused(tmp_path, profile, damage):
    path = tmp_path / "hot.npz"
    profile.save(path)
    damage(path)
    with pytest.raises(ProfileError):
        HotProfile.load(path)


def test_foreign_shape_is_refused(tmp_path, profile):
    path = tmp_path / "hot.npz"
    profile.save(path)
    with pytest.raises(ProfileError, match="2 layers x 4 experts"):
        HotProfile.load(path, num_layers=40, num_experts=256)


def test_bad_trace_is_refused():
    with pytest.raises(ProfileError):
        HotProfile.from_trace(np.zeros((3, 2)), 4)
    with pytest.raises(ProfileError):
        HotProfile.from_trace(np.full((1, 1, 2), 4), 4)
