"""Engine warm-up compiles the kernels of eager steps: after DeviceLayerPager.warm_kernels, steps of any size
(prefill token ranges, whole-layer groups, batches past the captured sizes) and prefetch rounds compile no Triton
kernel, so no request pauses for a compile (what vLLM's JIT monitor reports as a latency spike).

Each case has an expert count of its own, so its kernels are new to the process: the warm-up must compile some
(the hook sees compiles), and the steps after it none.

Run on a GPU: PYTHONPATH=pager:app:bench python -m pytest tests/gpu/test_kernel_warmup_gpu.py -m gpu -q
"""

from __future__ import annotations

import contextlib
import random

import pytest
import torch

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available():
    pytest.skip("no CUDA GPU", allow_module_level=True)

from bigmoe_pager.core.host_pager import TierSizes  # noqa: E402
from bigmoe_pager.core.ssd_service import SsdService  # noqa: E402
from bigmoe_pager.core.stats import PagerStats  # noqa: E402
from ssd_testkit import loaded_layers, make_direct_checkpoint  # noqa: E402
from triton import knobs  # noqa: E402

LAYERS, K, P = 2, 4, 4
TOKENS = [1, 2, 3, 5, 8, 13, 16, 17, 31, 32, 33, 64, 100, 300]  # past the captured sizes, prefill-like ones too

CASES = [  # experts (distinct per case: new kernels), VRAM slots, RAM slots, SSD read-ahead, policy
    pytest.param(24, 10, 24, False, "lfu-duel", id="full-ram-lfu-duel"),
    pytest.param(40, 40, 40, False, "lru", id="full-ram-lru-wide"),
    pytest.param(28, 10, 20, False, "lfu-duel", id="ssd-lfu-duel"),
    pytest.param(36, 12, 20, True, "lfu-duel", id="ssd-read-ahead"),
    pytest.param(160, 130, 150, False, "lfu-duel", id="ssd-past-128-slots"),  # SSD requests of a 256-id block
]


@pytest.fixture
def compiles(monkeypatch):
    """The repr of every kernel Triton compiles while the test runs (name and argument specializations)."""
    seen: list[str] = []
    monkeypatch.setattr(knobs.runtime, "jit_post_compile_hook", lambda **kw: seen.append(kw["repr"]))
    return seen


def _layers(root, experts: int, vram: int, ram: int, read_ahead: bool, policy: str):
    ckpt = make_direct_checkpoint(root, "fp8", num_layers=LAYERS, num_experts=experts)
    stats = PagerStats(LAYERS, "cuda")
    pagers = loaded_layers(ckpt, TierSizes(experts, vram, ram), "cuda", stats, read_ahead=read_ahead, policy=policy)
    svc = None
    if ram < experts:
        svc = SsdService(
            ckpt.store(retries=1),
            [p.ram.records for p in pagers],
            read_ahead=read_ahead,
            io_workers=4,
            max_requests=max(16, vram),
            read_timeout_s=5.0,
            sinks=[stats.tier(layer, "ssd") for layer in range(LAYERS)],
        )
    for layer, p in enumerate(pagers):
        p.start(ckpt.layout.slot_buffers(vram, "cuda"), None if svc is None else svc.fetcher(layer))
    return ckpt, pagers, svc


def _serve(ckpt, pagers, experts: int, rng: random.Random) -> None:
    """Steps as the vLLM adapter makes them outside graphs, each followed by a prefetch round on a side stream."""
    side = torch.cuda.Stream()
    whole = ckpt.layout.slot_buffers(experts, "cuda")
    for tokens in TOKENS:
        ids = torch.tensor([rng.sample(range(experts), K) for _ in range(tokens)], dtype=torch.int32, device="cuda")
        predicted = torch.tensor([rng.sample(range(experts), P) for _ in range(tokens)], device="cuda")
        for layer in pagers:
            ranges = [slice(0, tokens)] if layer.fits(ids) else layer.token_chunks(ids)
            for rows in ranges:
                layer.step(ids[rows])
            layer.fill_layer_buffer(ids, whole)
            layer.prefetch(predicted, side)
    torch.cuda.synchronize()


@pytest.mark.parametrize("experts,vram,ram,read_ahead,policy", CASES)
def test_after_warm_up_no_eager_step_or_prefetch_round_compiles(
    tmp_path, compiles, experts, vram, ram, read_ahead, policy
):
    ckpt, pagers, svc = _layers(tmp_path, experts, vram, ram, read_ahead, policy)
    with contextlib.ExitStack() as running:
        if svc is not None:
            running.enter_context(svc)
        for layer in pagers:
            layer.warm_kernels((torch.int32, torch.int64), predict_width=P)
        warmed = list(compiles)
        compiles.clear()
        _serve(ckpt, pagers, experts, random.Random(experts))
        if svc is not None:
            svc.check()
    assert warmed, "the warm-up compiled nothing: this case's kernels were not new, so the test shows nothing"
    assert compiles == [], "\n".join(compiles)
