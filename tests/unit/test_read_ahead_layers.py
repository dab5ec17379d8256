"""BIGMOE_SSD_READ_AHEAD_LAYERS: each layer's fork also posts the SSD reads of layers further ahead, from those
layers' routers applied to its hidden state (the live predictor), and every step still reads the right bytes.
The real SSD service and mailbox kernels run in Triton's interpreter; the device-driven pagers on CPU tensors."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from bigmoe_pager.adapters.vllm.predictor import Predictor
from bigmoe_pager.adapters.vllm.routing import Routing
from bigmoe_pager.core import ssd_mailbox as mb
from bigmoe_pager.core.host_pager import TierSizes
from bigmoe_pager.core.ssd_service import SsdService
from bigmoe_pager.core.stats import PagerStats
from bigmoe_pager.settings import PagerSettings, SettingsError
from ssd_testkit import NEEDS_INTERPRETER, loaded_layers, make_checkpoint
from test_ssd_read_ahead import slot_bytes, wanted

pytestmark = [pytest.mark.timeout(240), pytest.mark.filterwarnings("ignore::DeprecationWarning")]

EXPERTS, LAYERS, K, VRAM, RAM, TOKENS = 10, 4, 2, 2, 4, 3
HIDDEN = TOKENS  # token t's hidden state is the t-th unit vector; every router ranks PAIRS[t] first for it
PAIRS = [(RAM + 2 * t, RAM + 2 * t + 1) for t in range(TOKENS)]  # experts no tier holds before token t


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return make_checkpoint(tmp_path_factory.mktemp("ckpt"), "fp8", num_layers=LAYERS, num_experts=EXPERTS)


def paged_layers(ckpt, depth: int = 1):
    """What the predictor reads of vLLM's paged layers, over started pagers that share one SSD service (their RAM
    tables judge `depth` depths of reads ahead apart, as the adapter builds them for BIGMOE_SSD_READ_AHEAD_LAYERS)."""
    stats = PagerStats(LAYERS)
    sizes = TierSizes(EXPERTS, VRAM, RAM)
    pagers = loaded_layers(ckpt, sizes, "cpu", stats, read_ahead=True, read_ahead_layers=depth)
    service = SsdService(
        ckpt.store(retries=1),
        [p.ram.records for p in pagers],
        mailbox=True,
        read_ahead=True,
        max_requests=8,
        io_workers=2,
        read_timeout_s=5.0,
        sinks=[stats.tier(layer, "ssd") for layer in range(LAYERS)],
    )
    runners, layers = {}, []
    for i, pager in enumerate(pagers):
        pager.start(ckpt.layout.slot_buffers(VRAM, "cpu"), service.fetcher(i))
        name = f"model.layers.{i}.mlp.experts"
        gate = -torch.ones(EXPERTS, HIDDEN)
        for t, pair in enumerate(PAIRS):
            gate[list(pair), t] = 1.0
        runners[name] = SimpleNamespace(gate=SimpleNamespace(weight=gate))
        layers.append(
            SimpleNamespace(
                layer_name=name,
                _moe_index=i,
                _num_experts=EXPERTS,
                moe_config=SimpleNamespace(experts_per_token=K),
                pager=pager,
                _runners=runners,
            )
        )
    return layers, service, stats


def decode(ckpt, depth: int):
    """TOKENS tokens through every layer, the live predictor forking after each layer's paging; token t's ids
    at every layer are PAIRS[t], what every router proposes for its hidden state (so every proposal is right).
    Returns the bytes each step's kernel read, per layer the reads posted ahead while the second token's
    first layer ran (the first token only fills the tiers: before a layer's first step, its warm RAM rows
    are all as recent as its latest step, which a proposal never evicts), and the layers."""
    layers, service, stats = paged_layers(ckpt, depth)
    env = {"BIGMOE_PAGER": "1", "BIGMOE_PREDICT": "router", "BIGMOE_SSD_READ_AHEAD": "1"}
    settings = PagerSettings.from_env({**env, "BIGMOE_SSD_READ_AHEAD_LAYERS": str(depth)})
    predictor = Predictor(settings, Routing(settings), lambda i: layers[i + 1] if i + 1 < LAYERS else None, True)
    seen = []

    def posted() -> list[int]:
        counts = stats.read()
        return [l.pager.counters(counts)["ram"].prefetched for l in layers]

    with service:
        for t, pair in enumerate(PAIRS):
            hidden = torch.eye(HIDDEN)[t : t + 1]
            ids = torch.tensor([pair], dtype=torch.int32)
            for layer in layers:
                before = posted()
                with predictor.ahead(layer, hidden) as fork:
                    slots = layer.pager.step(ids)
                    fork()
                service.check()
                if t == 1 and layer._moe_index == 0:
                    early = [b - a for a, b in zip(before, posted())]
                for expert, slot in zip(pair, slots.reshape(-1).tolist()):
                    got = slot_bytes(layer.pager, slot)
                    assert torch.equal(got, wanted(ckpt, layer._moe_index, expert)), (t, layer._moe_index, expert)
                    seen.append(got)
    return seen, early, layers


@NEEDS_INTERPRETER
@pytest.mark.parametrize("depth", [2, 3])
def test_later_layers_reads_are_posted_as_early_as_the_depth_and_steps_read_the_same_bytes(ckpt, depth):
    one, early_one, _ = decode(ckpt, depth=1)
    deep, early_deep, layers = decode(ckpt, depth=depth)
    assert len(one) == len(deep) == TOKENS * LAYERS * K and all(torch.equal(a, b) for a, b in zip(one, deep))
    # While layer 0 ran: K reads posted (nothing of the pair was in RAM) for layer 1 at depth 1, for 1 .. D at D.
    assert early_one == [0, K] + [0] * (LAYERS - 2)
    assert early_deep == [0] + [K] * depth + [0] * (LAYERS - depth - 1)
    # Each depth's reads are judged in their own round of the RAM table (SlotTable gates): layer d's table judged
    # the reads layer 0 posted d layers ahead as used, in round d.
    for d in range(1, depth + 1):
        table = layers[d].pager.ram.table
        assert len(table.rounds) == depth and int(table.round_state(d).used_score) > 0, d
        assert int(table.round_state(d).wasted_score) == 0, d


def test_depth_is_a_setting_that_needs_read_ahead():
    assert PagerSettings.from_env({"BIGMOE_SSD_READ_AHEAD_LAYERS": "4"}).ssd_read_ahead_layers == 4
    off = PagerSettings.from_env({"BIGMOE_SSD_READ_AHEAD_LAYERS": "4"})
    assert Predictor(off, Routing(off), lambda i: None, True).read_ahead_layers == 1  # read-ahead itself is off
    with pytest.raises(SettingsError, match="BIGMOE_SSD_READ_AHEAD_LAYERS='-1' is not valid"):
        PagerSettings.from_env({"BIGMOE_SSD_READ_AHEAD_LAYERS": "-1"})
