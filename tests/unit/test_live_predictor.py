"""BIGMOE_PREDICT=router: its settings; how the adapter finds layer l+1's router; the proposals reaching the next
layer's DeviceLayerPager (CPU tensors, the pager's Triton kernels under Triton's interpreter) without changing
what any step reads; the priority of a replayed trace's predictions; the recorded predicted_ids and their score.

vLLM's CPU build never drives the pager from the device, so the prefetch path is proven here, one level below
vLLM; tests/e2e/test_live_predictor_vllm.py runs the predictor inside real vLLM (host-driven: recorded only)."""

from __future__ import annotations

import logging
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import score_predictor  # scripts/ is on pytest's pythonpath (pyproject)
import torch
from bigmoe_bench import traces
from bigmoe_pager.adapters.vllm import predictor as predictor_module
from bigmoe_pager.adapters.vllm.predictor import NextRouter, Predictor, next_router, vllm_whole_forward_capture
from bigmoe_pager.adapters.vllm.routing import Routing
from bigmoe_pager.core.prediction import LivePredictions, predict_next
from bigmoe_pager.core.stats import PagerStats
from bigmoe_pager.settings import PagerSettings, SettingsError
from test_device_layer import loaded_layer, record_bytes, slot_bytes
from test_pager import make_layout, make_records

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")  # the interpreter's own int() of loop bounds

HIDDEN = 24
EXPERTS = 16

# ---- settings ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "env,predict,top",
    [
        ({}, "off", 0),
        ({"BIGMOE_PREDICT": "router"}, "router", 0),
        ({"BIGMOE_PREDICT": "off", "BIGMOE_PREDICT_TOP": "6"}, "off", 6),
        ({"BIGMOE_PREDICT": " router ", "BIGMOE_PREDICT_TOP": "12"}, "router", 12),
    ],
)
def test_predict_settings_parse_and_round_trip(env, predict, top):
    s = PagerSettings.from_env(env)
    assert (s.predict, s.predict_top) == (predict, top)
    assert PagerSettings.from_env(s.to_env()) == s


@pytest.mark.parametrize("value,high", [(None, False), ("0", False), ("1", True)])
def test_prefetch_stream_priority_is_a_setting(value, high):
    env = {"BIGMOE_PREDICT": "router"} if value is None else {"BIGMOE_PREFETCH_HIGH_PRIORITY": value}
    s = PagerSettings.from_env(env)
    assert s.prefetch_high_priority is high
    live = Predictor(s, routing=None, layer_after=lambda i: None, on_device=False).live
    assert live.priority == (LivePredictions.HIGH_PRIORITY if high else 0)


def test_each_join_placement_a_capture_uses_is_logged_once(monkeypatch, caplog):
    """Where a captured prefetch is joined decides how much it overlaps, so the engine's log says it (once each)."""
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    whole = [True]
    p = Predictor(
        PagerSettings(),
        routing=None,
        layer_after=lambda i: None,
        on_device=False,
        whole_forward_captured=lambda: whole[0],
    )
    on_gpu = SimpleNamespace(device=torch.device("cuda"))
    with caplog.at_level(logging.WARNING, logger="vllm.bigmoe_pager"):
        assert [p._join_later(on_gpu) for _ in range(3)] == [True] * 3
        whole[0] = False
        assert [p._join_later(on_gpu) for _ in range(3)] == [False] * 3
    lines = [r.getMessage() for r in caplog.records if "joined at" in r.getMessage()]
    assert len(lines) == 2
    assert "next layer's MoE call" in lines[0] and "end of this layer's MoE call" in lines[1]


@pytest.mark.parametrize("mode", ["NONE", "PIECEWISE", "FULL"])
def test_a_capture_is_a_piece_only_under_vllms_piecewise_mode(mode):
    """vLLM 0.33's V2 model runner captures FULL graphs with the forward context at NONE: those captures hold the
    whole forward too, so only PIECEWISE (and no forward context at all) joins the prefetch inside the layer."""
    from vllm.config import CUDAGraphMode, VllmConfig
    from vllm.forward_context import set_forward_context

    assert vllm_whole_forward_capture() is False  # no vLLM forward: a capture of unknown extent
    with set_forward_context(None, VllmConfig(), cudagraph_runtime_mode=CUDAGraphMode[mode]):
        assert vllm_whole_forward_capture() is (mode != "PIECEWISE")


@pytest.mark.parametrize(
    "env,message",
    [
        ({"BIGMOE_PREDICT": "mlp"}, "BIGMOE_PREDICT='mlp' is not valid; expected off / router"),
        ({"BIGMOE_PREDICT": "1"}, "BIGMOE_PREDICT='1' is not valid; expected off / router"),
        ({"BIGMOE_PREDICT_TOP": "-3"}, "BIGMOE_PREDICT_TOP='-3' is not valid; expected a non-negative integer"),
        ({"BIGMOE_PREDICT_TOP": "many"}, "BIGMOE_PREDICT_TOP='many' is not valid"),
    ],
)
def test_bad_predict_settings_give_one_line(env, message):
    with pytest.raises(SettingsError) as e:
        PagerSettings.from_env(env)
    assert message in str(e.value) and "\n" not in str(e.value)


# ---- a model of paged layers as the adapter sees them ------------------------------------------


def router(seed: int, experts: int = EXPERTS, dtype=torch.float32) -> torch.Tensor:
    return torch.randn(experts, HIDDEN, generator=torch.Generator().manual_seed(seed)).to(dtype)


def fake_layer(index: int, runners: dict, pager=None, name: str | None = None, top_k: int = 2):
    """What Predictor reads of a PagedRoutedExperts: its names, index, expert count, top-k, pager and runners."""
    return SimpleNamespace(
        layer_name=name or f"model.layers.{index}.mlp.experts",
        _moe_index=index,
        _num_experts=EXPERTS,
        moe_config=SimpleNamespace(experts_per_token=top_k),
        pager=pager,
        _runners=runners,
    )


def model(layers: int, vram: int, top_k: int = 2, warm=None, gates=None):
    """Paged layers over started CPU DeviceLayerPagers, one step run; runners[name].gate.weight is each one's router."""
    layout = make_layout(False)
    records = make_records(layout, EXPERTS, seed=7)
    stats = PagerStats(layers)
    runners, out = {}, []
    for i in range(layers):
        pager = loaded_layer(layout, records, vram, EXPERTS, warm=warm)
        pager.layer, pager.stats_table = i, stats
        pager.start(layout.slot_buffers(vram, "cpu"))
        pager.step(torch.tensor([pager.order[:2]]))  # a first step: the other warm experts are now cold
        layer = fake_layer(i, runners, pager, top_k=top_k)
        gate = (gates or {}).get(i, SimpleNamespace(weight=router(100 + i)))
        runners[layer.layer_name] = SimpleNamespace(gate=gate)
        out.append(layer)
    return out, records, layout, stats


def predictor(layers, env: dict, routing: Routing | None = None) -> Predictor:
    settings = PagerSettings.from_env({"BIGMOE_PAGER": "1", **env})
    routing = routing or Routing(settings)
    after = {l._moe_index: l for l in layers}
    return Predictor(settings, routing, lambda i: after.get(i + 1), on_device=True)


def hidden(tokens: int, seed: int) -> torch.Tensor:
    return torch.randn(tokens, HIDDEN, generator=torch.Generator().manual_seed(seed))


def not_proposed(x: torch.Tensor, layer: int, top: int) -> list[int]:
    """Experts layer `layer`'s router does not propose for x: warmed into VRAM, the proposal must be copied in."""
    proposed = set(predict_next(x, router(100 + layer), top).reshape(-1).tolist())
    return [e for e in range(EXPERTS) if e not in proposed]


# ---- finding the next layer's router ------------------------------------------------------------


@pytest.mark.parametrize(
    "case,expect",
    [
        ("found", "router"),
        ("top set", "router"),
        ("bf16 router", "router"),
        ("last layer", None),
        ("next is the MTP drafter's", None),
        ("this is the MTP drafter's", None),
        ("no runner", "no MoERunner.gate"),
        ("runner without gate", "no MoERunner.gate"),
        ("fp8 router", "not a float [E, H] matrix"),
        ("router of another width", f"expected ({EXPERTS}, {HIDDEN})"),
        ("router of another expert count", f"expected ({EXPERTS}, {HIDDEN})"),
    ],
)
def test_the_next_layers_router_is_found_or_refused_with_a_reason(case, expect):
    runners: dict = {}
    this = fake_layer(3, runners, name="mtp.layers.48.mlp.experts" if case.startswith("this is") else None)
    nxt = fake_layer(4, runners, name="mtp.layers.48.mlp.experts" if case.startswith("next is") else None, top_k=3)
    weight = {
        "bf16 router": router(1, dtype=torch.bfloat16),
        "fp8 router": router(1).to(torch.float8_e4m3fn),
        "router of another width": torch.zeros(EXPERTS, HIDDEN + 8),
        "router of another expert count": torch.zeros(EXPERTS + 1, HIDDEN),
    }.get(case, router(1))
    if case != "no runner":
        runners[nxt.layer_name] = SimpleNamespace(
            gate=None if case == "runner without gate" else SimpleNamespace(weight=weight)
        )
    got = next_router(this, None if case == "last layer" else nxt, hidden(2, 0), 5 if case == "top set" else 0)
    if expect is None:
        assert got is None
    elif expect == "router":
        assert isinstance(got, NextRouter) and got.layer is nxt and got.router is weight
        assert got.top == (5 if case == "top set" else 3)  # BIGMOE_PREDICT_TOP, else the next layer's top-k
    else:
        assert isinstance(got, str) and expect in got and "MoE layer 4" in got and "\n" not in got


# ---- proposals into the next layer's pager --------------------------------------------------------


@pytest.mark.parametrize("tokens,top,vram", [(1, 2, 8), (2, 3, 10), (1, 4, 6)])
def test_proposals_land_in_the_next_layers_slots_and_change_no_step(tokens, top, vram):
    x = hidden(tokens, seed=tokens + top)
    proposed = sorted(set(predict_next(x, router(101), top).reshape(-1).tolist()))
    cold = not_proposed(x, 1, top)
    layers, records, layout, stats = model(2, vram, warm=cold)
    plain, _, _, plain_stats = model(2, vram, warm=cold)
    before = x.clone()
    with predictor(layers, {"BIGMOE_PREDICT": "router", "BIGMOE_PREDICT_TOP": str(top)}).ahead(layers[0], x):
        pass  # layer 0's own paging and kernel run here
    assert torch.equal(x, before)  # the hidden state layer 0 computes with is left as it was
    nxt = layers[1].pager
    assert all(int(nxt.pager.vram.expert_slot[e]) >= 0 for e in proposed)
    assert stats.snapshot(1)["vram"].prefetched == len(proposed)
    assert stats.snapshot(0)["vram"].prefetched == 0  # only the next layer is fed
    # The router keeps the final say: the next step pages its own ids; each slot it names holds that expert.
    ids = torch.tensor([[proposed[0], cold[0]]] * tokens, dtype=torch.int64)
    for layer_set in (layers, plain):
        slots = layer_set[1].pager.step(ids)
        for expert, slot in zip(ids.flatten().tolist(), slots.flatten().tolist()):
            assert torch.equal(slot_bytes(layer_set[1].pager, slot), record_bytes(layout, records, expert))
    assert stats.snapshot(1)["vram"].misses < plain_stats.snapshot(1)["vram"].misses  # the proposed one was a hit


@pytest.mark.parametrize("forks", [True, False], ids=["caller forks after its paging", "caller never forks"])
def test_the_proposal_is_made_where_the_caller_forks_or_at_the_end_of_the_call(forks):
    x = hidden(1, seed=5)
    proposed = set(predict_next(x, router(101), 2).reshape(-1).tolist())
    layers, _, _, stats = model(2, 6, warm=not_proposed(x, 1, 2))
    with predictor(layers, {"BIGMOE_PREDICT": "router"}).ahead(layers[0], x) as fork:
        assert stats.snapshot(1)["vram"].prefetched == 0  # nothing yet: layer 0's own paging goes first
        if forks:
            fork()
            assert stats.snapshot(1)["vram"].prefetched == len(proposed)
            fork()  # once per call
    assert stats.snapshot(1)["vram"].prefetched == len(proposed)


@pytest.mark.parametrize(
    "env",
    [
        {},
        {"BIGMOE_PREDICT": "off"},
        {"BIGMOE_PREDICT": "router", "BIGMOE_PAGER": "0"},
        {"BIGMOE_PREDICT": "router", "BIGMOE_ROUTE_REPLAY": "with-predictions"},
        {"BIGMOE_PREDICT": "router", "BIGMOE_PREFETCH_CHAINED_ONLY": "1"},
        {"BIGMOE_PREDICT": "router", "BIGMOE_PREFETCH_CHAIN": "1"},
    ],
    ids=["default", "off", "pager off", "replayed predictions win", "chained forwards only", "chain on, uncaptured"],
)
def test_nothing_is_proposed_when_off_or_when_a_replayed_trace_carries_predictions(env, tmp_path: Path):
    if env.get("BIGMOE_ROUTE_REPLAY"):
        trace = traces.named_trace("standard", 8, 2, EXPERTS, 2)
        traces.save_trace(tmp_path / "r.npz", trace, traces.predictions(trace, 1.0, 1.0, EXPERTS))
        env = {**env, "BIGMOE_ROUTE_REPLAY": str(tmp_path / "r.npz")}
    x = hidden(1, 3)
    layers, _, _, stats = model(2, 6, warm=not_proposed(x, 1, 2))  # a live proposal would copy 2 experts in
    predictor(layers, env).propose(layers[0], x)
    assert stats.snapshot(1)["vram"].prefetched == 0


@pytest.mark.parametrize(
    "extra",
    [{}, {"BIGMOE_PREFETCH_CHAIN": "1", "BIGMOE_PREFETCH_CHAINED_ONLY": "0"}],
    ids=["chain off", "chain on, every forward"],
)
def test_a_replayed_trace_without_predictions_leaves_the_live_predictor_on(tmp_path: Path, extra):
    traces.save_trace(tmp_path / "plain.npz", traces.named_trace("standard", 8, 2, EXPERTS, 2))
    x = hidden(1, 3)
    layers, _, _, stats = model(2, 6, warm=not_proposed(x, 1, 2))
    env = {"BIGMOE_PREDICT": "router", "BIGMOE_ROUTE_REPLAY": str(tmp_path / "plain.npz"), **extra}
    predictor(layers, env).propose(layers[0], x)
    assert stats.snapshot(1)["vram"].prefetched == 2  # top-k (2) proposed, neither resident


def test_a_replayed_traces_predictions_are_prefetched_into_the_next_layer_after_its_rows_replay(tmp_path: Path):
    trace = traces.named_trace("standard", 8, 2, EXPERTS, 2)
    traces.save_trace(tmp_path / "r.npz", trace, traces.predictions(trace, 1.0, 1.0, EXPERTS))
    settings = PagerSettings.from_env({"BIGMOE_PAGER": "1", "BIGMOE_ROUTE_REPLAY": str(tmp_path / "r.npz")})
    routing = Routing(settings)
    wanted = sorted(set(trace[0, 1].tolist()))  # layer 1's experts for row 0: what the trace predicts at recall 1
    layers, _, _, stats = model(2, 6, warm=[e for e in range(EXPERTS) if e not in wanted])
    live = predictor(layers, {"BIGMOE_ROUTE_REPLAY": str(tmp_path / "r.npz")}, routing)
    routing.hook(0, torch.zeros(1, 2, dtype=torch.int64))  # layer 0 replays row 0
    with live.ahead(layers[0], hidden(1, 0)):
        pass
    assert stats.snapshot(1)["vram"].prefetched == len(wanted)
    assert sorted(e for e in wanted if layers[1].pager.pager.vram.expert_slot[e] >= 0) == wanted


def test_an_unusable_router_warns_once_and_predicts_nothing_there(caplog):
    gates = {1: SimpleNamespace(weight=router(1).to(torch.float8_e4m3fn)), 2: None}
    x = hidden(1, 0)
    layers, _, _, stats = model(4, 6, warm=not_proposed(x, 3, 2), gates=gates)
    live = predictor(layers, {"BIGMOE_PREDICT": "router"})
    with caplog.at_level(logging.WARNING, logger="vllm.bigmoe_pager"):
        for step in range(3):
            for layer in layers:
                live.propose(layer, x)
    lines = [r.getMessage() for r in caplog.records if "BIGMOE_PREDICT" in r.getMessage()]
    assert len(lines) == 1 and "MoE layer 0 predicts nothing" in lines[0]
    assert stats.snapshot(1)["vram"].prefetched == 0 and stats.snapshot(2)["vram"].prefetched == 0
    assert stats.snapshot(3)["vram"].prefetched == 2  # layer 3's router is usable: layer 2 feeds it


@pytest.mark.parametrize("next_pager", ["not started", "host-driven"])
def test_a_pager_not_yet_started_or_host_driven_is_not_fed(next_pager):
    x = hidden(1, 0)
    layers, _, _, stats = model(2, 6, warm=not_proposed(x, 1, 2))
    if next_pager == "not started":
        layers[1].pager.pager = None  # as before vLLM's first forward has started the layers
    else:
        layers[1].pager = SimpleNamespace()  # a host-driven pager: nothing to prefetch into
    predictor(layers, {"BIGMOE_PREDICT": "router"}).propose(layers[0], x)
    assert stats.snapshot(1)["vram"].prefetched == 0


# ---- recorded proposals and their score -------------------------------------------------------------


@pytest.mark.parametrize(
    "layers_n,top,steps,depth", [(3, 0, [1, 4, 1, 1], 1), (4, 5, [2, 1, 3], 1), (4, 0, [3, 1], 3), (5, 4, [2, 2], 5)]
)
def test_recorded_proposals_are_the_traces_predicted_ids_and_score(tmp_path: Path, layers_n, top, steps, depth):
    """depth (BIGMOE_SSD_READ_AHEAD_LAYERS, reads ahead off): the proposals for layers 2..depth ahead are recorded as
    predicted_ids_ahead, each that layer's router on this layer's hidden state, the last columns -1."""
    path = tmp_path / "trace.npz"
    layers, _, _, _ = model(layers_n, 6)
    settings = PagerSettings.from_env({"BIGMOE_PAGER": "1", "BIGMOE_TRACE_PATH": str(path)})
    routing = Routing(settings)
    env = {"BIGMOE_PREDICT": "router", "BIGMOE_PREDICT_TOP": str(top), "BIGMOE_TRACE_PATH": str(path)}
    live = predictor(layers, {**env, "BIGMOE_SSD_READ_AHEAD_LAYERS": str(depth)}, routing)
    states = []
    for n, tokens in enumerate(steps):
        x = hidden(tokens, seed=n)
        states.append(x)
        for layer in layers:
            routing.hook(layer._moe_index, torch.topk(x @ router(100 + layer._moe_index).t(), 2).indices)
            with live.ahead(layer, x):  # as PagedRoutedExperts.paged_forward runs the layer's paging and kernel
                pass
    routing.save_trace()
    topk, predicted = traces.load_trace(path, EXPERTS), traces.load_predictions(path, EXPERTS)
    width = top or 2
    assert predicted.dtype == np.int32 and predicted.shape == (sum(steps), layers_n, width)
    assert (predicted[:, -1] == -1).all()  # the last layer has no next one
    x = torch.cat(states)
    for l in range(layers_n - 1):
        assert (predicted[:, l] == predict_next(x, router(101 + l), width).numpy()).all()
    deeper = traces.load_predictions_ahead(path, EXPERTS)
    reached = min(depth, layers_n - 1)  # a depth past the model's last layer proposes nothing and is not written
    if reached == 1:
        assert deeper is None
    else:
        assert deeper.shape == (reached - 1, sum(steps), layers_n, width)
        for ahead in range(2, reached + 1):
            rows = deeper[ahead - 2]
            assert (rows[:, layers_n - ahead :] == -1).all()  # no layer that far ahead in the model
            for l in range(layers_n - ahead):
                assert (rows[:, l] == predict_next(x, router(100 + l + ahead), width).numpy()).all()
    result = score_predictor.score_depths(topk, predicted, deeper, EXPERTS)
    assert [row["layer"] for row in result["per_layer"]] == list(range(layers_n - 1))
    assert 0.0 <= result["overall"]["recall"] <= 1.0 and result["chance"]["recall"] == pytest.approx(width / EXPERTS)
    assert [d["ahead"] for d in result["further_ahead"]] == list(range(2, reached + 1))
    for d in result["further_ahead"]:
        assert [row["layer"] for row in d["per_layer"]] == list(range(layers_n - d["ahead"]))


@pytest.mark.parametrize("width,expect", [(HIDDEN, "router"), (HIDDEN + 8, "repacked as")])
def test_a_router_that_vllm_repacked_is_used_through_its_own_product(width, expect):
    """vLLM's CPU build prepacks the router's GEMM on AVX-512 BF16 hosts and empties `weight`: the proposal then
    comes from the gate's own `cpu_linear`, and equals the one its unpacked weight gives."""
    runners: dict = {}
    this, nxt = fake_layer(3, runners), fake_layer(4, runners, top_k=3)
    weight = router(7)
    packed = SimpleNamespace(
        weight=torch.empty(0),
        bias=None,
        output_size=EXPERTS,
        input_size=width,
        cpu_linear=lambda x, w, b: x.to(weight.dtype) @ weight.t(),  # stands in for the packed kernel's product
    )
    runners[nxt.layer_name] = SimpleNamespace(gate=packed)
    got = next_router(this, nxt, hidden(2, 0), 0)
    if expect != "router":
        assert isinstance(got, str) and expect in got
        return
    x = hidden(5, 1)
    assert isinstance(got, NextRouter) and got.top == 3
    assert torch.equal(predict_next(x, got.router, 3), predict_next(x, weight, 3))
