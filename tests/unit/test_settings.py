"""The BIGMOE_* contract between the app and the plugins."""

from __future__ import annotations

from pathlib import Path

import pytest
from bigmoe_pager.plugin import UnsupportedVllm, check_vllm_version
from bigmoe_pager.settings import PagerSettings, SettingsError, unknown_variables


def test_defaults_leave_vllm_alone():
    s = PagerSettings.from_env({})
    assert not s.enabled and not s.ngram
    assert s.slots_for(0, 4, 16) == (16, 16)


@pytest.mark.parametrize(
    "env,layer,expected",
    [
        ({"BIGMOE_VRAM_SLOTS": "4"}, 2, (4, 16)),
        ({"BIGMOE_VRAM_SLOTS": "4", "BIGMOE_RAM_SLOTS": "8"}, 0, (4, 8)),
        ({"BIGMOE_VRAM_SLOTS": "2,3,4,5", "BIGMOE_RAM_SLOTS": "9"}, 3, (5, 9)),
        ({"BIGMOE_VRAM_SLOTS": "40"}, 1, (16, 16)),
    ],
)
def test_per_layer_slots(env, layer, expected):
    assert PagerSettings.from_env(env).slots_for(layer, 4, 16) == expected


@pytest.mark.parametrize(
    "env,message",
    [
        ({"BIGMOE_VRAM_SLOTS": "x"}, "BIGMOE_VRAM_SLOTS='x' is not valid"),
        ({"BIGMOE_PAGER": "maybe"}, "BIGMOE_PAGER='maybe' is not valid; expected 1 or 0"),
        ({"BIGMOE_COMPRESS": "zip"}, "expected on / off / auto"),
        ({"BIGMOE_EVICTION": "fifo"}, "BIGMOE_EVICTION='fifo' is not valid; expected lfu / lru"),
        ({"BIGMOE_READ_TIMEOUT_S": "-1"}, "expected a positive number"),
        ({"BIGMOE_IO_WORKERS": "-2"}, "expected a non-negative integer"),
    ],
)
def test_bad_values_give_one_line(env, message):
    with pytest.raises(SettingsError) as e:
        PagerSettings.from_env(env)
    assert message in str(e.value) and "\n" not in str(e.value)


@pytest.mark.parametrize(
    "env,message",
    [
        ({"BIGMOE_VRAM_SLOTS": "8", "BIGMOE_RAM_SLOTS": "4"}, "RAM slots must be >= VRAM slots"),
        ({"BIGMOE_VRAM_SLOTS": "0"}, "needs at least 1"),
        ({"BIGMOE_VRAM_SLOTS": "1,2"}, "lists 2 values but the model has 4 MoE layers"),
    ],
)
def test_slot_rules(env, message):
    with pytest.raises(SettingsError, match=message):
        PagerSettings.from_env(env).slots_for(0, 4, 16)


def test_round_trip_through_the_environment_and_a_file(tmp_path: Path):
    s = PagerSettings(
        enabled=True,
        vram_slots=(8,),
        ram_slots=(12, 13),
        paging_file=tmp_path / "p.bmpf",
        compress="on",
        cuda_graphs=True,
        read_timeout_s=2.5,
        eviction="lru",
    )
    assert PagerSettings.from_env(s.to_env()) == s
    file = tmp_path / "bigmoe.toml"
    file.write_text('enabled = true\nvram_slots = [8]\nram_slots = "12,13"\ncompress = "on"\n')
    from_file = PagerSettings.from_env({"BIGMOE_SETTINGS": str(file), "BIGMOE_COMPRESS": "off"})
    assert from_file.enabled and from_file.ram_slots == (12, 13) and from_file.compress == "off"


@pytest.mark.parametrize("text,message", [("enabled = ", "is not valid TOML"), ("slots = 3", "unknown keys ['slots']")])
def test_bad_settings_file(tmp_path: Path, text, message):
    file = tmp_path / "bigmoe.toml"
    file.write_text(text)
    with pytest.raises(SettingsError, match=message.replace("[", r"\[").replace("]", r"\]")):
        PagerSettings.from_env({"BIGMOE_SETTINGS": str(file)})


def test_codec_auto_follows_the_paging_file(tmp_path):
    assert PagerSettings(compress="auto").use_codec() is False
    assert PagerSettings(compress="auto", paging_file=tmp_path / "x").use_codec() is None  # as its header says
    assert PagerSettings(compress="off", paging_file=tmp_path / "x").use_codec() is False
    assert PagerSettings(compress="on", paging_file=tmp_path / "x").use_codec() is True


@pytest.mark.parametrize(
    "version,ok",
    [("0.32.0", True), ("0.33.1", True), ("0.25.1", True), ("0.31.2", False), ("0.320.0", False), ("1.0.0", False)],
)
def test_vllm_versions(version, ok):
    if ok:
        check_vllm_version(version)
    else:
        with pytest.raises(UnsupportedVllm, match="supports vLLM 0.25.x, 0.32.x, 0.33.x"):
            check_vllm_version(version)


@pytest.mark.parametrize("raw,value", [(None, None), ("0", 0), ("50", 50), (" 100 ", 100)])
def test_the_prefetch_gate_threshold_is_a_percent_or_the_pagers_default(raw, value):
    env = {} if raw is None else {"BIGMOE_PREFETCH_MIN_USED_PERCENT": raw}
    s = PagerSettings.from_env(env)
    assert s.prefetch_min_used_percent == value and PagerSettings.from_env(s.to_env()) == s


@pytest.mark.parametrize("raw", ["101", "-1", "half"])
def test_a_prefetch_gate_threshold_outside_0_to_100_is_one_line(raw):
    with pytest.raises(SettingsError) as e:
        PagerSettings.from_env({"BIGMOE_PREFETCH_MIN_USED_PERCENT": raw})
    assert "BIGMOE_PREFETCH_MIN_USED_PERCENT" in str(e.value) and "from 0 to 100" in str(e.value)
    assert "\n" not in str(e.value)


@pytest.mark.parametrize(
    "env,lines",
    [
        ({"BIGMOE_VRAM_SLOTS": "50", "BIGMOE_HOME": "/h", "VLLM_X": "1"}, []),
        (
            {"BIGMOE_VRAM_SLOT": "50"},
            ["BIGMOE_VRAM_SLOT is not a bigmoe setting and is ignored; did you mean BIGMOE_VRAM_SLOTS?"],
        ),
        (
            {"BIGMOE_READ_PIECE_KIB": "1024"},
            ["BIGMOE_READ_PIECE_KIB is not a bigmoe setting and is ignored (a typo, or a setting since removed?)"],
        ),
    ],
)
def test_variables_nothing_reads_are_named_with_the_closest_setting(env, lines):
    assert unknown_variables(env) == lines


def test_the_plugin_says_once_per_process_which_variables_it_ignores(monkeypatch, caplog):
    from bigmoe_pager import plugin

    monkeypatch.setenv("BIGMOE_EVICTON", "lru")
    plugin.process_settings.cache_clear()
    try:
        with caplog.at_level("WARNING", logger="vllm.bigmoe_pager"):
            plugin.process_settings()
            plugin.process_settings()
    finally:
        plugin.process_settings.cache_clear()
    said = [r.getMessage() for r in caplog.records if "BIGMOE_EVICTON" in r.getMessage()]
    assert said == ["bigmoe: BIGMOE_EVICTON is not a bigmoe setting and is ignored; did you mean BIGMOE_EVICTION?"]
