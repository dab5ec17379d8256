"""SSD read-ahead on a real GPU, inside a captured CUDA graph: reads posted for predicted experts,
waited for by the step that needs them; what every step reads is its expert's exact bytes.

Run on the H200: PYTHONPATH=pager:app:bench python -m pytest tests/gpu/test_ssd_read_ahead_gpu.py -m gpu -q
"""

from __future__ import annotations

import random
import time

import pytest
import torch

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available():
    pytest.skip("no CUDA GPU", allow_module_level=True)

from bigmoe_pager.core import ssd_mailbox as mb  # noqa: E402
from bigmoe_pager.core.device_layer import DeviceLayerPager  # noqa: E402
from bigmoe_pager.core.host_pager import TierSizes  # noqa: E402
from bigmoe_pager.core.ssd_service import SsdService  # noqa: E402
from bigmoe_pager.core.stats import PagerStats  # noqa: E402
from ssd_testkit import FakeFaultyIO, loaded_layers, make_direct_checkpoint  # noqa: E402

LAYERS, EXPERTS, VRAM, RAM, K, P = 2, 16, 3, 6, 2, 4


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    root = tmp_path_factory.mktemp("ckpt")
    return make_direct_checkpoint(root, "fp8", num_layers=LAYERS, num_experts=EXPERTS)


def _wanted(ckpt, layer, expert):
    ref = ckpt.reference(layer, expert)
    return torch.cat([ref[c.offset : c.offset + c.nbytes] for c in ckpt.layout.components])


def _slot_bytes(ckpt, pager, slot):
    return torch.cat([pager.buffers[c.name][slot].reshape(-1).view(torch.uint8).cpu() for c in ckpt.layout.components])


def _build(ckpt, io=None, io_workers=4):
    stats = PagerStats(LAYERS, "cuda")
    pagers = loaded_layers(ckpt, TierSizes(EXPERTS, VRAM, RAM), "cuda", stats, read_ahead=True)
    svc = SsdService(
        ckpt.store(io=io, retries=1),
        [p.ram.records for p in pagers],
        read_ahead=True,
        io_workers=io_workers,
        max_requests=16,
        read_timeout_s=5.0,
        sinks=[stats.tier(layer, "ssd") for layer in range(LAYERS)],
    )
    for layer, p in enumerate(pagers):
        p.start(ckpt.layout.slot_buffers(VRAM, "cuda"), svc.fetcher(layer))
    return pagers, svc, stats


@pytest.mark.parametrize("accuracy", [0.0, 0.8, 1.0])
def test_graph_replays_read_exact_bytes_with_reads_posted_ahead(ckpt, accuracy):
    pagers, svc, stats = _build(ckpt)
    ids = [torch.full((1, K), -1, dtype=torch.int64, device="cuda") for _ in range(LAYERS)]
    ahead = [torch.full((P,), -1, dtype=torch.int64, device="cuda") for _ in range(LAYERS)]
    nxt = [torch.full((P,), -1, dtype=torch.int64, device="cuda") for _ in range(LAYERS)]
    rng = random.Random(int(accuracy * 10))

    def guess(true_ids):
        right = [e for e in true_ids if rng.random() < accuracy]
        wrong = [e for e in rng.sample(range(EXPERTS), P) if e not in true_ids]
        return (right + wrong + [-1] * P)[:P]

    def token():
        """One decode token: layer 1's reads posted before layer 0 steps, each layer's next step prefetched."""
        pagers[1].read_ahead(ahead[1])
        out = []
        for layer in range(LAYERS):
            out.append(pagers[layer].step(ids[layer]))
            pagers[layer].prefetch(nxt[layer])
        return out

    def set_inputs(plan, following):
        for layer in range(LAYERS):
            ids[layer].copy_(torch.tensor([plan[layer]]))
            ahead[layer].copy_(torch.tensor(guess(plan[layer])))
            nxt[layer].copy_(torch.tensor(guess(following[layer])))

    plans = [[rng.sample(range(EXPERTS), K) for _ in range(LAYERS)] for _ in range(41)]
    with svc:
        set_inputs(plans[0], plans[1])
        token()  # warm-up outside the graph: compiles the kernels
        torch.cuda.synchronize()
        svc.check()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            outs = token()
        for t in range(1, 40):
            set_inputs(plans[t], plans[t + 1])
            graph.replay()
            torch.cuda.synchronize()  # releases the GIL: the host workers answer while the GPU waits
            svc.check()
            for layer in range(LAYERS):
                for expert, slot in zip(plans[t][layer], outs[layer].reshape(-1).tolist()):
                    got = _slot_bytes(ckpt, pagers[layer], slot)
                    assert torch.equal(got, _wanted(ckpt, layer, expert)), (t, layer, expert, slot)
        time.sleep(0.2)  # posted reads nobody waited for land
        ram = stats.snapshot()["ram"]
        reads = sum(c["reads"] for c in svc.stats()["layers"])
        assert reads <= ram.misses + ram.prefetched and int(svc.box[mb.GPU_ERROR]) == 0
        if accuracy == 1.0:
            assert ram.prefetch_used > 0


def test_a_step_waiting_for_slow_posted_reads_writes_their_hurry_words(ckpt):
    """On the GPU: a step needing experts whose posted reads a slow disk still brings waits for them and writes each
    read's seq into its hurry word (system-scope release, seen by the host's reader), then reads exact bytes."""
    pagers, svc, _ = _build(ckpt, io=FakeFaultyIO(then="slow", delay_s=0.5), io_workers=1)
    layer = pagers[1]
    cold = [e for e in range(EXPERTS) if layer.ram_slot_for_load(e) is None][:2]
    with svc:
        layer.step(torch.tensor([layer.order[:1]], dtype=torch.int32, device="cuda"))
        torch.cuda.synchronize()
        layer.read_ahead(torch.tensor(cold + [-1, -1], device="cuda"))
        posted = layer.ram.posted.clone()
        remapped = layer.step(torch.tensor([cold], dtype=torch.int32, device="cuda"))
        torch.cuda.synchronize()
        svc.check()
        rows = torch.nonzero(posted).reshape(-1).tolist()
        assert rows, "nothing was posted"
        hurry = mb.hurry_base(svc.entries) + svc.post_base[1]
        assert [int(svc.box[hurry + r]) for r in rows] == [int(posted[r]) for r in rows]
        for expert, slot in zip(cold, remapped.reshape(-1).tolist()):
            assert torch.equal(_slot_bytes(ckpt, layer, slot), _wanted(ckpt, 1, expert))
