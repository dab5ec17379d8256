"""The device-driven mode's start-up rules, checked against vLLM's real CompilationConfig (CPU build):
CUDA graphs only for batches whose ids fit the slots, no host-side trace recording under graphs,
and the mode is never chosen off CUDA."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest

vllm = pytest.importorskip("vllm", reason="real vLLM (installer/install.sh) is needed")

from bigmoe_pager.adapters.vllm import device as vllm_device  # noqa: E402
from bigmoe_pager.adapters.vllm.glue import EngineModeError  # noqa: E402
from bigmoe_pager.settings import PagerSettings  # noqa: E402
from vllm.config import CompilationConfig  # noqa: E402
from vllm.config.compilation import CUDAGraphMode  # noqa: E402


def engine(mode: CUDAGraphMode, sizes: list[int]):
    """What the adapter reads of vLLM's config: its compilation config (the rest of VllmConfig is not used)."""
    return SimpleNamespace(compilation_config=CompilationConfig(cudagraph_mode=mode, cudagraph_capture_sizes=sizes))


@pytest.mark.parametrize(
    "mode,sizes,slots,top_k,refused",
    [
        (CUDAGraphMode.FULL_AND_PIECEWISE, [1, 2, 4, 8], 32, 8, True),
        (CUDAGraphMode.FULL_AND_PIECEWISE, [1, 2, 4], 32, 8, False),
        (CUDAGraphMode.PIECEWISE, [1, 2, 4, 8, 16], 102, 8, True),
        (CUDAGraphMode.FULL_DECODE_ONLY, [1, 2, 4, 8, 12], 102, 8, False),
        (CUDAGraphMode.NONE, [1, 2, 4, 8, 512], 8, 8, False),
    ],
)
def test_graphs_are_refused_when_a_captured_batch_can_outnumber_the_slots(mode, sizes, slots, top_k, refused):
    config = engine(mode, sizes)
    if not refused:
        vllm_device.check_graph_sizes(config, 3, slots, top_k)
        return
    with pytest.raises(EngineModeError) as e:
        vllm_device.check_graph_sizes(config, 3, slots, top_k)
    message = str(e.value)
    assert "\n" not in message and "MoE layer 3" in message
    assert f"--max-cudagraph-capture-size {slots // top_k}" in message


def test_trace_recording_is_refused_under_graphs_and_allowed_eager(tmp_path: Path):
    settings = PagerSettings(enabled=True, trace_path=tmp_path / "t.npz")
    with pytest.raises(EngineModeError, match="--enforce-eager"):
        vllm_device.refuse_trace_in_graphs(settings, engine(CUDAGraphMode.FULL_AND_PIECEWISE, [1, 2]))
    vllm_device.refuse_trace_in_graphs(settings, engine(CUDAGraphMode.NONE, [1, 2]))
    vllm_device.refuse_trace_in_graphs(PagerSettings(enabled=True), engine(CUDAGraphMode.FULL_AND_PIECEWISE, [1, 2]))


@pytest.mark.parametrize("env", [{"BIGMOE_PAGER": "1"}, {"BIGMOE_PAGER": "1", "BIGMOE_CUDA_GRAPHS": "1"}])
def test_the_device_driven_mode_is_never_chosen_off_cuda(env):
    assert not vllm_device.on_cuda()  # this machine: vLLM's CPU build
    assert vllm_device.wanted(PagerSettings.from_env(env)) is False


def test_a_whole_layer_step_runs_the_kernel_over_every_expert_with_the_routers_ids():
    """BIGMOE_PREFILL_BUFFER: vLLM's kernel sees what the unpaged layer has (E experts, expert ids),
    and the layer's parameters are its slots again afterwards."""
    import torch
    from bigmoe_pager.core.device_layer import DeviceLayerPager
    from bigmoe_pager.core.host_pager import TierSizes
    from bigmoe_pager.core.stats import PagerStats
    from test_pager import make_layout, make_records

    layout = make_layout(True)
    experts, vram = 8, 2
    records = make_records(layout, experts, seed=6)
    pager = DeviceLayerPager(layout, TierSizes(experts, vram, experts), "cpu", layer=0, stats=PagerStats(1))
    for e in range(experts):
        for name, part in layout.views(records[e]).items():
            pager.ram_views()[name][e].copy_(part)
            pager.mark_loaded(e, name)
    slots = layout.slot_buffers(vram, "cpu")
    pager.start(slots)
    layer = SimpleNamespace(
        pager=pager,
        _num_experts=experts,
        _layout=layout,
        **{name: torch.nn.Parameter(t, requires_grad=False) for name, t in slots.items()},
    )
    seen = {}

    def kernel(x, weights, ids):
        seen.update(
            ids=ids,
            rows={name: getattr(layer, name).shape[0] for name in slots},
            w2=getattr(layer, "w2_weight").data.clone(),
        )
        return x

    ids = torch.tensor([[5, 1], [7, 5], [0, 3]])
    x = torch.randn(3, 4)
    assert vllm_device._whole_layer_step(vllm_device.DeviceParts(), layer, x, torch.ones(3, 2), ids, kernel) is x
    assert seen["ids"] is ids and set(seen["rows"].values()) == {experts}
    c = layout["w2_weight"]
    for expert in (0, 1, 3, 5, 7):
        assert torch.equal(
            seen["w2"][expert].reshape(-1).view(torch.uint8), records[expert, c.offset : c.offset + c.nbytes]
        )
    assert all(
        getattr(layer, name).data_ptr() == t.data_ptr() and getattr(layer, name).shape == t.shape
        for name, t in slots.items()
    )


def test_a_chunked_step_runs_vllms_kernel_on_each_range_after_its_paging():
    import torch

    events = []

    class Pager:
        def token_chunks(self, ids):
            return [slice(0, 2), slice(2, 3)]

        def step(self, ids):  # DeviceLayerPager.step has settled the range's SSD reads when it returns
            events.append(("step", ids.shape[0]))
            return ids

    def kernel(x, weights, ids):
        events.append(("kernel", x.shape[0]))
        return x

    x = torch.arange(6.0).reshape(3, 2)
    out = vllm_device._chunked_step(Pager(), x, torch.ones(3, 2), torch.zeros(3, 2, dtype=torch.int32), kernel)
    assert torch.equal(out, x)
    assert events == [("step", 2), ("kernel", 2), ("step", 1), ("kernel", 1)]


@pytest.mark.parametrize("read_ahead", [False, True])
def test_the_ssd_service_serves_the_paged_layers_and_leaves_an_unbuilt_mtp_layer_without_slots(tmp_path, read_ahead):
    """Speculative decoding off: vLLM builds no MTP layer, but the checkpoint's store still names its experts."""
    import json
    import sys

    import torch
    from bigmoe_bench import synth_experts
    from bigmoe_pager.core.expert_store import CheckpointStore
    from bigmoe_pager.core.stats import PagerStats

    root = tmp_path / "ckpt"
    synth_experts.write_checkpoint(
        root, 128, 64, 2, 4, fp8=False, shards=1, prefix="model.language_model.layers.{layer}.mlp.experts.{expert}."
    )
    mtp = {}
    gen = torch.Generator().manual_seed(3)
    for e in range(4):
        for suffix, t in synth_experts.expert_tensors(128, 64, False, gen).items():
            mtp[f"mtp.layers.0.mlp.experts.{e}." + suffix] = t
    from safetensors.torch import save_file

    save_file(mtp, str(root / "mtp.safetensors"))
    (root / "config.json").write_text(json.dumps({"num_hidden_layers": 2}))
    store = CheckpointStore(root, synth_experts.make_layout(128, 64, False))
    assert store.model_layers == [0, 1, 2]
    layers = [
        SimpleNamespace(
            _moe_index=i,
            _ssd_source=SimpleNamespace(store=store, layer=i),
            pager=SimpleNamespace(ram=SimpleNamespace(records=torch.zeros(2, store.layout.pitch, dtype=torch.uint8))),
        )
        for i in range(2)
    ]
    parts = vllm_device.DeviceParts()
    parts.stats = PagerStats(2)
    fetchers = vllm_device._ssd_fetchers(parts, layers, PagerSettings(enabled=True, ssd_read_ahead=read_ahead))
    service = parts.ssd
    try:
        assert sorted(fetchers) == [0, 1]
        assert [len(rows) for rows in service._rows] == [2, 2, 0]
        assert service.read_ahead == read_ahead  # BIGMOE_SSD_READ_AHEAD reaches the service the layers post to
    finally:
        service.close()
        store.close()


@pytest.mark.parametrize(
    "asked,ram,reads_ahead",
    [(True, 256, True), (True, 512, False), (False, 256, False), (False, 512, False)],
)
def test_a_layer_reads_ahead_only_when_asked_and_some_experts_live_only_on_ssd(asked, ram, reads_ahead):
    from bigmoe_pager.core.host_pager import TierSizes

    sizes = TierSizes(experts=512, vram=64, ram=ram)
    assert vllm_device.reads_ahead(PagerSettings(enabled=True, ssd_read_ahead=asked), sizes) == reads_ahead


@pytest.mark.parametrize("gate", [None, 0, 35])
def test_a_layers_vram_table_takes_the_prefetch_gate_it_is_given(gate):
    from bigmoe_pager.core.device_layer import DeviceLayerPager
    from bigmoe_pager.core.host_pager import TierSizes
    from bigmoe_pager.core.slots import MIN_USED_PERCENT
    from bigmoe_pager.core.stats import PagerStats
    from test_pager import make_layout, make_records

    layout = make_layout(True)
    experts, vram = 8, 2
    records = make_records(layout, experts, seed=1)
    sizes = TierSizes(experts, vram, experts)
    pager = DeviceLayerPager(layout, sizes, "cpu", layer=0, stats=PagerStats(1), prefetch_gate=gate)
    for e in range(experts):
        for name, part in layout.views(records[e]).items():
            pager.ram_views()[name][e].copy_(part)
            pager.mark_loaded(e, name)
    pager.start(layout.slot_buffers(vram, "cpu"))
    assert pager.pager.vram.min_used_percent == (MIN_USED_PERCENT if gate is None else gate)
    assert pager.ram.full  # (a full RAM tier has no read-ahead table: the threshold is the VRAM table's alone)
