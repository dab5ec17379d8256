"""plan: the estimator over hardware fixtures x presets (including plans it must refuse),
overrides, refusal and --force, and the `bigmoe plan` command."""

from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path

import pytest
from bigmoe.cli.plan import EXIT_REFUSED
from bigmoe.cli.plan import plan as plan_command
from bigmoe.machine.hardware import Hardware
from bigmoe.model import presets
from bigmoe.plan.planner import Overrides, PlanError, plan
from bigmoe.plan.speed import PCIE_EFFICIENCY, PCIE_GBPS_PER_LANE, speeds_for
from bigmoe_pager.settings import PagerSettings
from click.testing import CliRunner

HARDWARE = Path(__file__).resolve().parents[1] / "fixtures" / "hardware"
GIB = 1 << 30
REASON_KEYS = (
    "device",
    "dtype",
    "context",
    "kv_cache",
    "vram_slots",
    "ram_slots",
    "compress",
    "ssd_source",
    "ngram",
    "env",
    "argv",
)
DIRS = {"rtx3060-32g": ("/data/hf", "/home/me/paging"), "h200": ("/srv/models", "/srv/paging")}


def machine(name: str) -> Hardware:
    return Hardware.from_dict(json.loads((HARDWARE / f"{name}.json").read_text()))


def dirs(name: str, **more) -> Overrides:
    model_dir, paging_dir = DIRS.get(name, ("/home/me/models", "/home/me/paging"))
    return Overrides(model_dir=model_dir, paging_dir=paging_dir, **more)


# (machine, preset) -> (refusal text or None, device, pager on, SSD tier source, compressed)
EXPECTED = {
    ("rtx4090-wsl2", "tiny-moe"): (None, "cuda", False, "none", False),
    ("rtx4090-wsl2", "qwen3.6-35b-a3b"): (None, "cuda", True, "none", False),
    ("rtx4090-wsl2", "qwen3.8-flash-next"): (None, "cuda", True, "checkpoint", False),
    ("rtx3060-32g", "tiny-moe"): (None, "cuda", False, "none", False),
    # the checkpoint on SATA (0.5 GB/s assumed), the paging directory on NVMe: a raw copy there is six times cheaper
    ("rtx3060-32g", "qwen3.6-35b-a3b"): (None, "cuda", True, "paging file", False),
    ("rtx3060-32g", "qwen3.8-flash-next"): ("too little VRAM for the dense weights", "cuda", True, None, None),
    ("h200", "tiny-moe"): (None, "cuda", False, "none", False),
    ("h200", "qwen3.6-35b-a3b"): (None, "cuda", False, "none", False),
    ("h200", "qwen3.8-flash-next"): (None, "cuda", False, "none", False),
    ("hdd-only", "tiny-moe"): (None, "cuda", False, "none", False),
    ("hdd-only", "qwen3.6-35b-a3b"): (None, "cuda", True, "none", False),
    ("hdd-only", "qwen3.8-flash-next"): ("from an HDD", "cuda", True, "checkpoint", False),
    ("cpu-laptop", "tiny-moe"): (None, "cpu", True, "checkpoint", False),  # the demo pages (preset [plan])
    ("cpu-laptop", "qwen3.6-35b-a3b"): ("no GPU", "cpu", None, None, None),
    ("cpu-laptop", "qwen3.8-flash-next"): ("no GPU", "cpu", None, None, None),
}


@pytest.mark.parametrize("machine_name, preset_name", sorted(EXPECTED), ids=lambda v: v)
def test_plan_per_machine_and_preset(machine_name, preset_name):
    refusal, device, pager, source, compress = EXPECTED[(machine_name, preset_name)]
    p = plan(machine(machine_name), presets.load(preset_name), dirs(machine_name))
    assert p.device == device
    if refusal is None:
        assert p.refusals == () and p.runnable
    else:
        assert refusal in p.refusal and not p.runnable
    for actual, wanted in ((p.pager, pager), (p.ssd_source, source), (p.compress, compress)):
        if wanted is not None:
            assert actual == wanted
    check_invariants(p)


def check_invariants(p) -> None:
    for key in REASON_KEYS:
        assert isinstance(p.reasons.get(key), str) and len(p.reasons[key]) > 10, key
    if not p.refusals:
        for table in p.memory:
            assert table.fits is True, (table.tier, table.used_bytes, table.capacity_bytes)
    assert {t.tier for t in p.memory} >= ({"VRAM", "RAM"} if p.device == "cuda" else {"RAM"})
    assert any(t.tier.startswith("disk ") for t in p.memory)
    assert list(p.argv[:5]) == [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", p.model_path]
    assert p.argv[p.argv.index("--host") + 1] == "127.0.0.1"
    assert p.argv.count("--max-model-len") == 1 and p.argv[p.argv.index("--max-model-len") + 1] == str(p.context)
    assert p.argv[p.argv.index("--kv-cache-memory-bytes") + 1] == str(p.kv_cache_bytes)
    assert p.env["VLLM_PLUGINS"] == "bigmoe_experts,bigmoe_ngram"
    assert PagerSettings.from_env(p.env) == p.settings
    if p.pager and p.device == "cuda":  # the plugin picks the pager the command line was planned for
        assert p.settings.host_driven == ("--enforce-eager" in p.argv)
    if p.pager:
        for layer in (0, p.layers - 1):
            vram, ram = p.settings.slots_for(layer, p.layers, p.experts)
            assert p.top_k <= vram == p.vram_slots <= ram
    low, high = p.estimate.tpot_ms
    assert 0 < low <= high
    assert json.loads(json.dumps(p.to_dict()))["refusal"] == p.refusal


@pytest.mark.parametrize("compress", ["on", "off"])
@pytest.mark.parametrize("cuda_graphs", [True, False])
def test_the_plan_and_the_plugin_pick_the_same_pager(compress, cuda_graphs):
    """Only --eager makes the pager host-driven: both pagers read a compressed paging file."""
    ov = dirs("rtx4090-wsl2", compress=compress, cuda_graphs=cuda_graphs)
    p = plan(machine("rtx4090-wsl2"), presets.load("qwen3.8-flash-next"), ov)
    eager = "--enforce-eager" in p.argv
    assert eager == (not cuda_graphs)
    assert p.compress == (compress == "on")
    assert PagerSettings.from_env(p.env).host_driven == eager
    check_invariants(p)


def test_the_reference_job_on_a_4090_under_wsl2():
    p = plan(machine("rtx4090-wsl2"), presets.load("qwen3.8-flash-next"), dirs("rtx4090-wsl2"))
    assert p.top_k < p.vram_slots < p.ram_slots < p.experts
    assert p.env["VLLM_WSL2_ENABLE_PIN_MEMORY"] == "1"
    assert p.env["VLLM_USE_BREAKABLE_CUDAGRAPH"] == "1" and "--language-model-only" in p.argv
    assert p.settings.ngram and p.settings.cuda_graphs and p.settings.prefill_buffer
    assert not p.settings.use_codec() and p.ssd_source == "checkpoint"  # the device-driven pager reads raw records
    vram = next(t for t in p.memory if t.tier == "VRAM")
    assert vram.capacity_bytes - vram.used_bytes < p.layers * presets.load("qwen3.8-flash-next").arch.expert_bytes_fp8
    assert any("assumed" in a for a in p.assumptions)


def test_only_wsl2_gets_the_pinned_memory_variable():
    p = plan(machine("rtx3060-32g"), presets.load("qwen3.6-35b-a3b"), dirs("rtx3060-32g"))
    assert "VLLM_WSL2_ENABLE_PIN_MEMORY" not in p.env


def test_tiny_moe_without_a_gpu_plans_a_cpu_run_and_says_why():
    p = plan(machine("cpu-laptop"), presets.load("tiny-moe"), dirs("cpu-laptop"))
    assert (p.device, p.expert_dtype, p.pager) == ("cpu", "bf16", True)
    assert "no NVIDIA GPU" in p.reasons["device"] and "AMX" in p.reasons["dtype"]
    assert p.settings == PagerSettings(enabled=True, vram_slots=(8,), ram_slots=(12,), compress="off")


# ---- refusals -------------------------------------------------------------------------------


def with_disk(hw: Hardware, path: str, **changes) -> Hardware:
    return dataclasses.replace(
        hw, disks=tuple(dataclasses.replace(d, **changes) if d.path == path else d for d in hw.disks)
    )


REFUSALS = [
    pytest.param(
        "rtx4090-wsl2", Overrides(model_dir="/mnt/c/models", paging_dir="/home/me/paging"), "Windows drive", id="mnt-c"
    ),
    pytest.param("rtx4090-wsl2", dirs("rtx4090-wsl2", disk="nvme", disk_gib=150), "disk full", id="disk-full"),
    pytest.param("rtx4090-wsl2", dirs("rtx4090-wsl2", ram_slots=512), "out of memory", id="ram-oom"),
    pytest.param("rtx4090-wsl2", dirs("rtx4090-wsl2", vram_slots=200), "out of VRAM", id="vram-oom"),
    pytest.param("rtx3060-32g", dirs("rtx3060-32g"), "too little VRAM for the dense weights", id="dense-too-big"),
    pytest.param("cpu-laptop", dirs("cpu-laptop"), "no GPU", id="no-gpu"),
    pytest.param("h200", dirs("h200", disk="hdd", vram_gib=24), "HDD", id="stated-hdd"),
]


@pytest.mark.parametrize("machine_name, overrides, reason", REFUSALS)
def test_unsafe_plans_are_refused_and_force_records_it(machine_name, overrides, reason):
    preset = presets.load("qwen3.8-flash-next")
    p = plan(machine(machine_name), preset, overrides)
    assert reason in p.refusal and not p.runnable and not p.forced
    forced = plan(machine(machine_name), preset, dataclasses.replace(overrides, force=True))
    assert forced.forced and forced.runnable and forced.refusals == p.refusals


def test_no_o_direct_on_the_ssd_tier_is_refused():
    hw = with_disk(
        machine("rtx4090-wsl2"),
        "/home/me/paging",
        o_direct=False,
        o_direct_basis="open(x, O_DIRECT) failed: Invalid argument",
    )
    p = plan(hw, presets.load("qwen3.8-flash-next"), dirs("rtx4090-wsl2", compress="on"))
    assert p.ssd_source == "paging file" and "O_DIRECT reads do not work" in p.refusal


def test_no_room_for_a_paging_file_reads_the_checkpoint_instead():
    hw = with_disk(machine("rtx3060-32g"), "/home/me/paging", free_bytes=20 * GIB)
    p = plan(hw, presets.load("qwen3.6-35b-a3b"), dirs("rtx3060-32g", cuda_graphs=False))  # host-driven: would compress
    assert (p.compress, p.ssd_source, p.paging_file) == (False, "checkpoint", None)
    assert "no room" in p.reasons["compress"] and p.refusals == ()


def test_a_missing_hdd_tier_is_fine_when_ram_holds_every_expert():
    p = plan(machine("hdd-only"), presets.load("qwen3.6-35b-a3b"), dirs("hdd-only"))
    assert p.ram_slots == p.experts and p.ssd_source == "none" and p.refusals == ()


# ---- overrides ------------------------------------------------------------------------------


def test_explicit_overrides_beat_the_estimator():
    ov = dirs("rtx4090-wsl2", vram_slots=20, ram_slots=100, compress="off", context=8192)
    p = plan(machine("rtx4090-wsl2"), presets.load("qwen3.8-flash-next"), ov)
    assert (p.vram_slots, p.ram_slots, p.compress, p.context) == (20, 100, False, 8192)
    assert p.ssd_source == "checkpoint" and p.paging_file is None
    for key, flag in (
        ("vram_slots", "--vram-slots"),
        ("ram_slots", "--ram-slots"),
        ("compress", "--compress"),
        ("context", "--context"),
    ):
        assert flag in p.reasons[key]
    assert p.env["BIGMOE_VRAM_SLOTS"] == "20" and p.env["BIGMOE_RAM_SLOTS"] == "100"


def test_ram_slots_alone_lower_the_vram_slots():
    p = plan(machine("rtx4090-wsl2"), presets.load("qwen3.8-flash-next"), dirs("rtx4090-wsl2", ram_slots=12))
    assert p.vram_slots == p.ram_slots == 12 and "--ram-slots" in p.reasons["vram_slots"]


def test_a_stated_machine_replaces_the_probed_one():
    p = plan(
        machine("cpu-laptop"),
        presets.load("qwen3.8-flash-next"),
        dirs("cpu-laptop", gpu="RTX 4090", ram_gib=64, disk="nvme"),
    )
    assert p.device == "cuda" and p.refusals == ()
    assert p.hardware.gpu().stated and p.hardware.gpu().vram_total_bytes == 24 * GIB
    assert p.hardware.ram_total_bytes == 64 * GIB and p.hardware.disks[0].stated


def test_more_vram_means_more_slots_and_a_faster_token():
    results = [
        plan(
            machine("cpu-laptop"),
            presets.load("qwen3.8-flash-next"),
            dirs("cpu-laptop", vram_gib=v, ram_gib=64, disk="nvme"),
        )
        for v in (16, 24, 32, 48)
    ]
    slots = [p.vram_slots for p in results]
    slow = [p.estimate.tpot_ms[1] for p in results]
    assert slots == sorted(slots) and len(set(slots)) == 4
    assert slow == sorted(slow, reverse=True)


@pytest.mark.parametrize(
    "overrides, message",
    [
        (Overrides(context=10**7), "--context"),
        (Overrides(vram_slots=3), "top-k"),
        (Overrides(vram_slots=600), "experts per layer"),
        (Overrides(vram_slots=64, ram_slots=32), "RAM slots must be >= VRAM slots"),
        (Overrides(disk="floppy"), "--disk"),
        (Overrides(gpu="Voodoo 3"), "--vram-gib"),
        (Overrides(ram_gib=-4), "--ram-gib"),
        (Overrides(compress="maybe"), "--compress"),
    ],
)
def test_overrides_that_make_no_sense_raise_one_line(overrides, message):
    with pytest.raises(PlanError, match=message) as info:
        plan(machine("rtx4090-wsl2"), presets.load("qwen3.8-flash-next"), overrides)
    assert "\n" not in str(info.value)


def test_preset_flags_the_plan_owns_are_replaced():
    p = plan(machine("cpu-laptop"), presets.load("tiny-moe"), dirs("cpu-laptop", context=1024))
    assert p.argv.count("--max-model-len") == 1 and p.argv[p.argv.index("--max-model-len") + 1] == "1024"
    assert "--max-num-seqs" in p.argv


def test_pcie_speed_follows_the_link():
    gpu, disk = machine("h200").gpu(), machine("h200").disks[0]
    assert speeds_for(gpu, disk).pcie_gbps == pytest.approx(PCIE_GBPS_PER_LANE[5] * 16 * PCIE_EFFICIENCY)
    slow = dataclasses.replace(gpu, pcie_gen=3, pcie_width=8)
    assert speeds_for(slow, disk).pcie_gbps == pytest.approx(PCIE_GBPS_PER_LANE[3] * 8 * PCIE_EFFICIENCY)


# ---- the command ----------------------------------------------------------------------------


def run_plan(*args: str):
    return CliRunner().invoke(plan_command, list(args))


def test_plan_command_for_the_reference_job():
    result = run_plan("qwen3.8-flash-next", "--vram-gib", "24", "--ram-gib", "64", "--disk", "nvme", "--json")
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    tables = {t["tier"].split()[0]: t for t in data["memory"]}
    assert tables["VRAM"]["capacity_bytes"] == 24 * GIB and tables["VRAM"]["fits"] is True
    assert tables["RAM"]["capacity_bytes"] == 64 * GIB and tables["RAM"]["fits"] is True
    for table in data["memory"]:
        assert table["used_bytes"] == sum(r["bytes"] for r in table["rows"])
        assert all(r["reason"] for r in table["rows"])
    disk = tables["disk"]
    assert disk["capacity_bytes"] is None and any("--disk-gib" in n for n in data["notes"])
    assert all(data["reasons"][k] for k in REASON_KEYS)
    assert data["refusals"] == [] and data["argv"][1:3] == ["-m", "vllm.entrypoints.openai.api_server"]


def test_plan_command_checks_a_stated_disk():
    ok = run_plan(
        "qwen3.8-flash-next", "--vram-gib", "24", "--ram-gib", "64", "--disk", "nvme", "--disk-gib", "400", "--json"
    )
    assert ok.exit_code == 0 and all(t["fits"] for t in json.loads(ok.stdout)["memory"])
    full = run_plan(
        "qwen3.8-flash-next", "--vram-gib", "24", "--ram-gib", "64", "--disk", "nvme", "--disk-gib", "100", "--json"
    )
    assert full.exit_code == EXIT_REFUSED
    assert "disk full" in json.loads(full.stdout)["refusal"] and "--force" in full.stderr
    forced = run_plan(
        "qwen3.8-flash-next", "--vram-gib", "24", "--ram-gib", "64", "--disk", "nvme", "--disk-gib", "100", "--force"
    )
    assert forced.exit_code == 0 and "forced despite: disk full" in forced.stdout


def test_plan_command_text_names_every_choice():
    result = run_plan("qwen3.6-35b-a3b", "--gpu", "RTX 3060", "--ram-gib", "32", "--disk", "sata", "--disk-gib", "500")
    assert result.exit_code == 0, result.output
    command = f"vLLM: {sys.executable} -m vllm.entrypoints.openai.api_server --model "
    for label in ("VRAM slots", "RAM slots", "compression", "prefill", "SSD tier", "TPOT", command, "assumed:"):
        assert label in result.stdout


@pytest.mark.parametrize("flag, planned", [("--prefill-buffer", True), ("--no-prefill-buffer", False)])
def test_plan_command_takes_the_prefill_buffer_flag(flag, planned):
    result = run_plan(
        "qwen3.6-35b-a3b", "--gpu", "RTX 4090", "--ram-gib", "64", "--disk", "nvme", "--disk-gib", "500", flag
    )
    assert result.exit_code == 0, result.output
    assert f"set by {flag}" in result.stdout and ("prefill buffer " in result.stdout) is planned


@pytest.mark.parametrize(
    "args, code, text",
    [
        (["no-such-model"], 1, "unknown model"),
        (["tiny-moe", "--disk", "floppy"], 2, "floppy"),
        (["tiny-moe", "--vram-gib", "-3"], 2, "--vram-gib"),
        (["qwen3.8-flash-next", "--vram-gib", "24", "--vram-slots", "2"], 1, "top-k"),
    ],
)
def test_plan_command_bad_input_is_one_line(args, code, text):
    result = run_plan(*args)
    assert result.exit_code == code
    assert text in result.output and "Traceback" not in result.output


@pytest.mark.parametrize("context, batch", [(2048, 2048), (128, 1024)])
def test_batched_tokens_stay_within_what_vllm_accepts(context, batch):
    p = plan(machine("cpu-laptop"), presets.load("tiny-moe"), dirs("cpu-laptop", context=context))
    assert p.argv[p.argv.index("--max-num-batched-tokens") + 1] == str(batch)  # tiny-moe runs 8 sequences


def test_a_cpu_run_can_page_when_asked():
    p = plan(machine("cpu-laptop"), presets.load("tiny-moe"), dirs("cpu-laptop", vram_slots=8))
    assert (p.device, p.pager, p.vram_slots, p.ram_slots, p.ssd_source) == ("cpu", True, 8, 16, "none")
    assert p.env["BIGMOE_PAGER"] == "1" and p.env["BIGMOE_VRAM_SLOTS"] == "8" and "BIGMOE_RAM_SLOTS" not in p.env
    assert 0 < p.estimate.tpot_ms[0] <= p.estimate.tpot_ms[1] and p.estimate.pcie_mib_per_token[1] > 0
    check_invariants(p)
    demo = plan(machine("cpu-laptop"), presets.load("tiny-moe"), dirs("cpu-laptop", ram_slots=8))
    assert (demo.pager, demo.vram_slots, demo.ram_slots, demo.ssd_source) == (True, 8, 8, "checkpoint")


@pytest.mark.parametrize(
    "machine_name, preset_name, cuda_graphs, graphs_expected",
    [
        ("rtx4090-wsl2", "qwen3.6-35b-a3b", False, False),  # --eager: the host-driven pager
        ("rtx4090-wsl2", "qwen3.6-35b-a3b", None, True),  # the default; all experts in RAM, raw records: device-driven
        ("rtx4090-wsl2", "qwen3.8-flash-next", None, True),  # the reference job: raw SSD reads, device-driven
        ("rtx3060-32g", "qwen3.6-35b-a3b", True, True),
    ],
)
def test_cuda_graphs_asks_for_the_device_driven_pager_and_a_capture_size_that_fits(
    machine_name, preset_name, cuda_graphs, graphs_expected
):
    choice = {} if cuda_graphs is None else {"cuda_graphs": cuda_graphs}
    p = plan(machine(machine_name), presets.load(preset_name), dirs(machine_name, **choice))
    assert p.pager
    settings = PagerSettings.from_env(p.env)
    assert settings.cuda_graphs is graphs_expected
    if graphs_expected:
        assert "--enforce-eager" not in p.argv
        size = int(p.argv[p.argv.index("--max-cudagraph-capture-size") + 1])
        assert size >= 1 and size * p.top_k <= p.vram_slots
        assert "device-driven pager" in p.reasons["argv"]
    else:
        assert "--enforce-eager" in p.argv and "--max-cudagraph-capture-size" not in p.argv
        assert "host-driven" in p.reasons["argv"]


def _vram_row(p, name: str):
    vram = next(t for t in p.memory if t.tier == "VRAM")
    return next((r for r in vram.rows if r.item == name), None)


# (machine, preset, overrides) -> prefill buffer planned?
PREFILL = [
    ("rtx4090-wsl2", "qwen3.6-35b-a3b", {}, True),  # device-driven, VRAM to spare
    ("rtx4090-wsl2", "qwen3.6-35b-a3b", {"prefill_buffer": False}, False),
    ("rtx4090-wsl2", "qwen3.6-35b-a3b", {"cuda_graphs": False}, False),  # host-driven: token ranges
    ("rtx4090-wsl2", "qwen3.8-flash-next", {}, True),  # 2.3 GiB: under a quarter of the slots' VRAM
    ("rtx4090-wsl2", "qwen3.8-flash-next", {"compress": "on"}, True),  # compressed SSD tier: still device-driven
    ("h200", "qwen3.6-35b-a3b", {}, False),  # every expert resident: nothing paged
    ("hdd-only", "qwen3.6-35b-a3b", {}, True),
]


@pytest.mark.parametrize("machine_name, preset_name, more, planned", PREFILL, ids=str)
def test_the_prefill_buffer_is_reserved_in_vram_when_the_device_driven_pager_uses_it(
    machine_name, preset_name, more, planned
):
    p = plan(machine(machine_name), presets.load(preset_name), dirs(machine_name, **more))
    row = _vram_row(p, "prefill buffer")
    device_driven = p.pager and p.settings.cuda_graphs
    assert p.settings.prefill_buffer is (planned or not device_driven)  # only the device-driven pager reads it
    assert (row is not None) is planned
    assert p.reasons["prefill_buffer"]
    if planned:
        assert row.bytes == p.experts * p.expert_bytes
        assert "BIGMOE_PREFILL_BUFFER" not in p.env  # the plugin's default
        without = plan(machine(machine_name), presets.load(preset_name), dirs(machine_name, prefill_buffer=False))
        assert without.vram_slots > p.vram_slots  # its VRAM comes out of the slots
        assert without.env["BIGMOE_PREFILL_BUFFER"] == "0"


@pytest.mark.parametrize("compress", ["on", "off"])
def test_the_ram_tier_is_planned_at_raw_record_bytes_whatever_the_ssd_tier_holds(compress):
    """Both pagers expand a compressed record as it enters RAM: compression shrinks SSD bytes, not RAM."""
    preset = presets.load("qwen3.8-flash-next")
    p = plan(machine("rtx4090-wsl2"), preset, dirs("rtx4090-wsl2", compress=compress))
    ram = next(t for t in p.memory if t.tier == "RAM")
    row = next(r for r in ram.rows if r.item == "expert RAM slots")
    assert row.bytes == p.ram_slots * p.layers * p.expert_bytes
    assert ram.used_bytes <= ram.capacity_bytes
    assert p.compress is (compress == "on") and (p.ssd_source == "paging file") is (compress == "on")


# read GB/s (measured) of the checkpoint's disk and the paging directory's -> the SSD tier's source, compressed
SSD_BY_DISK = [
    ((3.0, 3.0), "checkpoint", False),
    ((0.25, 0.25), "checkpoint", False),  # a second copy on as slow a disk: compression saves under 20%
    ((0.5, 3.0), "paging file", False),  # a raw copy on the fast disk: no CPU spent, cheaper than compressed
    ((0.15, 0.4), "paging file", True),  # a slow paging disk too: 14% fewer bytes outweigh the expansion
]


@pytest.mark.parametrize("cuda_graphs", [True, False], ids=["graphs", "eager"])
@pytest.mark.parametrize("rates, source, compressed", SSD_BY_DISK, ids=str)
def test_the_ssd_tier_reads_where_a_gb_of_experts_costs_least(rates, source, compressed, cuda_graphs):
    """Either pager: the checkpoint in place, or a paging file of raw or compressed records, priced per GB of experts
    by the estimate's model; a paging file (a second copy) only where clearly cheaper."""
    hw = machine("rtx4090-wsl2")
    hw = with_disk(with_disk(hw, "/home/me/models", read_gbps=rates[0]), "/home/me/paging", read_gbps=rates[1])
    preset = presets.load("qwen3.8-flash-next")
    p = plan(hw, preset, dirs("rtx4090-wsl2", cuda_graphs=cuda_graphs))
    assert (p.ssd_source, p.compress, p.refusals) == (source, compressed, ())
    assert (p.paging_file is not None) == (source == "paging file")
    assert "measured" in p.reasons["compress"] and "ms per GB" in p.reasons["compress"]
    other = plan(hw, preset, dirs("rtx4090-wsl2", cuda_graphs=cuda_graphs, compress="off" if compressed else "on"))
    assert other.ram_slots == p.ram_slots  # the SSD tier's form buys no RAM slots
    if source == "paging file":  # the estimate agrees (a checkpoint may be kept within PAGING_MARGIN of a copy)
        assert p.estimate.tpot_ms[1] < other.estimate.tpot_ms[1]


@pytest.mark.parametrize("expand, compressed", [(10.0, True), (None, False)], ids=["fast-cpu-measured", "assumed"])
def test_the_probed_expansion_rate_decides_between_raw_and_compressed_records(expand, compressed):
    """A slow paging disk (0.6 GB/s) under a slower checkpoint: at the assumed 1.4 GB/s a thread compressed records
    save under 5% over raw ones; a CPU the probe measured at 10 GB/s makes them pay."""
    hw = machine("rtx4090-wsl2")
    hw = with_disk(with_disk(hw, "/home/me/models", read_gbps=0.15), "/home/me/paging", read_gbps=0.6)
    if expand is not None:
        hw = dataclasses.replace(hw, cpu_expand_gbps=expand, cpu_expand_basis="the pager's C decoder on one thread")
    p = plan(hw, presets.load("qwen3.8-flash-next"), dirs("rtx4090-wsl2"))
    assert (p.ssd_source, p.compress) == ("paging file", compressed)
    assert f"{'measured' if expand else 'assumed'}) " in p.reasons["compress"].split("expanded at")[1]


@pytest.mark.parametrize("cores, compressed", [(32, True), (2, False)])
def test_compressed_records_pay_only_with_cores_to_expand_them(cores, compressed):
    """Slow disks both (0.15 and 0.4 GB/s): four reader threads expand fast enough for 14% fewer bytes to pay; on
    two cores only two expand at once, and raw records cost less."""
    hw = machine("rtx4090-wsl2")
    hw = with_disk(with_disk(hw, "/home/me/models", read_gbps=0.15), "/home/me/paging", read_gbps=0.4)
    p = plan(dataclasses.replace(hw, cpu_cores=cores), presets.load("qwen3.8-flash-next"), dirs("rtx4090-wsl2"))
    assert (p.ssd_source, p.compress) == ("paging file", compressed)
    assert f"x {min(cores, 4)} CPU threads" in p.reasons["compress"]


def test_a_raw_paging_file_is_planned_on_disk_and_built_raw():
    hw = with_disk(machine("rtx4090-wsl2"), "/home/me/models", read_gbps=0.4)
    p = plan(hw, presets.load("qwen3.8-flash-next"), dirs("rtx4090-wsl2"))
    assert (p.ssd_source, p.compress) == ("paging file", False)
    assert "raw records" in p.reasons["ssd_source"]
    row = next(r for t in p.memory if t.tier.startswith("disk ") for r in t.rows if r.item == "paging file")
    assert row.bytes == p.experts * p.layers * p.expert_bytes and "raw records" in row.reason
    settings = PagerSettings.from_env(p.env)
    assert settings.paging_file is not None and not settings.use_codec()


def _utilization(p) -> float:
    return float(p.argv[p.argv.index("--gpu-memory-utilization") + 1])


@pytest.mark.parametrize("machine_name", ["rtx4090-wsl2", "h200", "rtx3060-32g"])
def test_vllm_is_told_the_share_of_the_card_the_plan_may_use(machine_name):
    """vLLM refuses to start unless this share of the card is free: never more than the probed free VRAM."""
    hw = machine(machine_name)
    p = plan(hw, presets.load("qwen3.6-35b-a3b"), dirs(machine_name))
    gpu = hw.gpu()
    assert 0 < _utilization(p) * gpu.vram_total_bytes <= gpu.vram_free_bytes


def test_a_stated_vram_budget_on_a_bigger_card_is_its_share_of_that_card():
    hw = machine("h200")
    card = hw.gpu().vram_total_bytes
    p = plan(hw, presets.load("qwen3.6-35b-a3b"), dirs("h200", vram_gib=24))
    assert p.hardware.gpu().stated and p.refusals == ()
    assert _utilization(p) == pytest.approx(24 * GIB / card, abs=0.01) and _utilization(p) * card <= 24 * GIB


def test_a_cpu_plan_sets_no_gpu_share():
    p = plan(machine("cpu-laptop"), presets.load("tiny-moe"), dirs("cpu-laptop"))
    assert p.device == "cpu" and "--gpu-memory-utilization" not in p.argv


@pytest.mark.parametrize("ram_slots, source", [(None, "none"), (128, "paging file")])
def test_the_ssd_tier_is_chosen_for_the_ram_slots_planned_not_for_what_ram_could_hold(ram_slots, source):
    """RAM holds all 256 of Qwen3.6's experts here; --ram-slots 128 still leaves an SSD tier, which a slow checkpoint
    disk (0.4 GB/s) makes worth a paging file on the fast one, priced as any SSD tier is."""
    hw = with_disk(machine("rtx4090-wsl2"), "/home/me/models", read_gbps=0.4)
    p = plan(hw, presets.load("qwen3.6-35b-a3b"), dirs("rtx4090-wsl2", ram_slots=ram_slots))
    assert (p.ssd_source, p.refusals) == (source, ())
    assert ("RAM holds every expert" in p.reasons["compress"]) is (ram_slots is None)


def test_a_cpu_presets_demo_ram_slots_are_what_the_ssd_choice_prices():
    p = plan(machine("cpu-laptop"), presets.load("tiny-moe"), dirs("cpu-laptop"))
    assert (p.device, p.ssd_source) == ("cpu", "checkpoint") and p.ram_slots < p.experts
    assert p.reasons["compress"].startswith("off, the checkpoint in place: the checkpoint at")
