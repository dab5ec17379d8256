"""The paged layers' warm order comes from a checked hot profile: hottest first, bad files refused in one line."""

from __future__ import annotations

import numpy as np
import pytest
from bigmoe_pager.adapters.vllm.process import PagerProcess
from bigmoe_pager.core.hot_profile import HotProfile
from bigmoe_pager.settings import PagerSettings, SettingsError


def settings(path) -> PagerSettings:
    return PagerSettings(enabled=True, hot_profile=path)


def warm_order(s: PagerSettings, moe_index: int, num_experts: int):
    return PagerProcess(s, on_device=False).warm_order(moe_index, num_experts)


def test_hottest_first_per_layer_and_unseen_layers_in_expert_order(tmp_path):
    counts = np.array([[1, 9, 9, 0], [5, 0, 7, 2]], dtype=np.int64)
    HotProfile(counts).save(tmp_path / "hot.npz")
    s = settings(tmp_path / "hot.npz")
    assert warm_order(s, 0, 4) == [1, 2, 0, 3]  # ties: lower id first
    assert warm_order(s, 1, 4) == [2, 0, 3, 1]
    assert warm_order(s, 2, 4) is None  # the MTP drafter's layer, say
    assert warm_order(PagerSettings(enabled=True), 0, 4) is None


@pytest.mark.parametrize("damage", ["not a zip", "wrong experts", "wrong version"])
def test_a_bad_profile_is_one_settings_line(tmp_path, damage):
    path = tmp_path / "hot.npz"
    if damage == "not a zip":
        path.write_bytes(b"\x00" * 64)
    elif damage == "wrong experts":
        HotProfile(np.ones((2, 8), dtype=np.int64)).save(path)
    else:
        np.savez(path, version=np.int64(99), counts=np.ones((2, 4), dtype=np.int64))
    with pytest.raises(SettingsError, match="BIGMOE_HOT_PROFILE") as e:
        warm_order(settings(path), 0, 4)
    assert "\n" not in str(e.value)
