"""BIGMOE_DEMAND_HOST_COPIER in the vLLM adapter: which layers hand their misses to the process's host copier when
paging starts, what happens when no copier can be had, and what the engine facts report. CPU pagers (Triton's
interpreter) stand in for the device's; the copier runs in its CPU mode."""

from __future__ import annotations

import logging
from types import SimpleNamespace

import pytest
import torch
from bigmoe_pager.adapters.vllm import device
from bigmoe_pager.adapters.vllm.predictor import Predictor
from bigmoe_pager.core.host_copier import MISS_SELF, HostCopierError
from bigmoe_pager.core.pager import ExpertPager
from bigmoe_pager.core.ram_tier import RamTier
from bigmoe_pager.settings import PagerSettings
from test_step_kernel import LAYOUT, records

EXPERTS, SLOTS = 16, 4


def paged_layer(full: bool = True) -> SimpleNamespace:
    """A layer as start_all sees it: its DeviceLayerPager's started ExpertPager, fused, over a full RAM tier; or a
    stand-in of one over a partial tier (which needs an SSD service to be built)."""
    if full:
        ram = RamTier(LAYOUT, EXPERTS, EXPERTS)
        ram.load_all(records(EXPERTS, seed=1))
        pager = ExpertPager(LAYOUT, EXPERTS, SLOTS, ram, fused=True, step_programs=2)
    else:
        pager = SimpleNamespace(ram=SimpleNamespace(full=False), fused=True, miss_mailbox=None, miss_words=None)
    return SimpleNamespace(pager=SimpleNamespace(pager_started=lambda: pager))


def process_with(predictor, layers) -> SimpleNamespace:
    copies = None if predictor is None else predictor.host_copies
    return SimpleNamespace(predictor=predictor, host_copies=copies, device=SimpleNamespace(started=True, layers=layers))


@pytest.fixture
def predictor():
    p = Predictor(PagerSettings(demand_host_copier=True), None, lambda i: None, on_device=False)
    yield p
    if p.copier is not None:
        p.copier.close()


def test_layers_over_full_ram_tiers_hand_their_misses_to_the_one_copier(predictor, caplog):
    full, partial, other = paged_layer(), paged_layer(full=False), paged_layer()
    process = process_with(predictor, [full, partial, other])
    with caplog.at_level(logging.WARNING, logger="vllm.bigmoe_pager"):
        device._misses_to_host(process, [full, partial, other])
    served = [layer.pager.pager_started() for layer in (full, other)]
    assert all(p.miss_mailbox is not None and p.miss_words is not None for p in served)
    assert partial.pager.pager_started().miss_mailbox is None  # an SSD read may rewrite a RAM row a DMA reads
    assert predictor.host_copies.serves_misses and predictor.copier.stats()["layers"] == 2
    assert [r.getMessage() for r in caplog.records] == [
        "bigmoe: 2 of 3 MoE layers hand their decode misses to a host thread (the GPU's copy engines)"
    ]
    assert device.misses_copied_by_steps(process) == 0
    served[0].miss_words[MISS_SELF] = 3  # what a step that gave up on the host would have counted
    assert device.misses_copied_by_steps(process) == 3


def test_a_copier_that_cannot_be_had_leaves_the_steps_copying_with_one_line(caplog):
    def refuse(_device):
        raise HostCopierError("host copier: C compiler 'cc' not found; install one (gcc or clang) or set CC")

    broken = SimpleNamespace(copier_for=refuse, serves_misses=False)
    layer = paged_layer()
    with caplog.at_level(logging.WARNING, logger="vllm.bigmoe_pager"):
        device._misses_to_host(process_with(SimpleNamespace(host_copies=broken), [layer]), [layer])
    pager = layer.pager.pager_started()
    assert pager.miss_mailbox is None and pager.miss_words is None and not broken.serves_misses
    (line,) = [r.getMessage() for r in caplog.records]
    assert "BIGMOE_DEMAND_HOST_COPIER" in line and "not found" in line and line.endswith("copy their misses themselves")


def test_a_prefetch_path_that_gives_the_copier_up_keeps_it_while_steps_use_it(predictor):
    layer = paged_layer()
    device._misses_to_host(process_with(predictor, [layer]), [layer])
    copier = predictor.copier
    predictor._without_host_copier(ValueError("a layer the copier cannot serve"))
    assert predictor.copier is copier and copier.stats()["error"] == 0  # still running for the steps


def test_no_miss_mailbox_no_facts():
    process = process_with(None, [paged_layer()])
    assert device.misses_copied_by_steps(process) is None
    assert device.misses_copied_by_steps(SimpleNamespace(device=None)) is None


def test_the_setting_is_off_unless_asked_for():
    assert PagerSettings().demand_host_copier is False
    assert PagerSettings.from_env({"BIGMOE_DEMAND_HOST_COPIER": "1"}).demand_host_copier is True
    with pytest.raises(Exception, match="BIGMOE_DEMAND_HOST_COPIER='maybe' is not valid"):
        PagerSettings.from_env({"BIGMOE_DEMAND_HOST_COPIER": "maybe"})


def test_the_copier_s_device_is_the_pagers(predictor):
    layer = paged_layer()
    device._misses_to_host(process_with(predictor, [layer]), [layer])
    assert predictor.copier.device == torch.device("cpu")
