"""The GPU-driven SSD path on CPU: the request kernel in Triton's interpreter, answered by the real host workers."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest
import torch
from bigmoe_pager.core import ssd_mailbox as mb
from bigmoe_pager.core.ssd_service import SsdError, SsdService
from ssd_testkit import NEEDS_INTERPRETER, ROOT, FakeFaultyIO, make_checkpoint

pytestmark = [NEEDS_INTERPRETER, pytest.mark.timeout(90)]

RAM_SLOTS = 4


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return make_checkpoint(tmp_path_factory.mktemp("ckpt"), "fp8", num_layers=2, num_experts=6)


def _service(ckpt, store=None, **kw):
    store = store or ckpt.store(io=kw.pop("io", None), retries=kw.pop("retries", 1))
    bufs = [torch.zeros(RAM_SLOTS, ckpt.layout.pitch, dtype=torch.uint8) for _ in range(ckpt.num_layers)]
    kw.setdefault("read_timeout_s", 5.0)
    return SsdService(store, bufs, mailbox=True, max_requests=8, **kw), bufs


@pytest.mark.parametrize("source", ["checkpoint", "compressed paging file"])
@pytest.mark.parametrize("reader", ["native", "python"])
def test_requests_through_the_mailbox_fill_slots_over_changing_ids(ckpt, reader, source, tmp_path):
    """The request kernel's rounds, answered by either reader (the native one's C threads, or the Python ones),
    from the checkpoint or from a compressed paging file (expanded by the Python threads, which then answer
    whichever reader was asked)."""
    store = None
    if source != "checkpoint":
        store = ckpt.decoded_store(ckpt.compressed_paging_file(tmp_path / "experts.bmpf"))
    svc, bufs = _service(ckpt, store, io_workers=2, reader=reader)
    experts = torch.full((6,), -1, dtype=torch.int32)  # fixed tensors, rewritten in place as in graph replay
    slots = torch.full((6,), -1, dtype=torch.int32)
    rounds = [(0, [1, 4, -1, 0], [0, 1, -1, 3]), (1, [5, 2], [2, 0]), (0, [3, -1, -1, 2, 1, 0], [1, -1, -1, 2, 0, 3])]
    with svc:
        assert svc.native == (reader == "native" and source == "checkpoint")
        assert ("cannot plan reads of a DecodedStore" in svc.reader_note) == (reader == "native" and bool(store))
        for layer, ex, sl in rounds:
            experts.fill_(-1)
            slots.fill_(-1)
            experts[: len(ex)] = torch.tensor(ex)
            slots[: len(sl)] = torch.tensor(sl)
            svc.request(layer, experts, slots)
            svc.check()
            for e, s in zip(ex, sl):
                if e >= 0:
                    assert torch.equal(bufs[layer][s, : ckpt.layout.record_bytes], ckpt.reference(layer, e)), (
                        layer,
                        e,
                        s,
                    )
        assert int(svc.box[mb.GPU_ERROR]) == 0 == int(svc.error_flag[0])
        assert sum(c["reads"] for c in svc.stats()["layers"]) == 3 + 2 + 4


def test_failed_read_is_flagged_to_the_gpu_and_raised_by_check(ckpt):
    svc, _ = _service(ckpt, io=FakeFaultyIO(then="eio"))
    with svc:
        t0 = time.monotonic()
        svc.request(1, torch.tensor([3, 4], dtype=torch.int32), torch.tensor([0, 1], dtype=torch.int32))
        assert time.monotonic() - t0 < 10  # the host error ends the GPU's wait, not its timeout
        assert int(svc.box[mb.GPU_ERROR]) == mb.GPU_SAW_HOST_ERROR == int(svc.error_flag[0])
        with pytest.raises(SsdError, match=r"layer 1 expert [34] into RAM slot [01] failed: ReadError.*EIO"):
            svc.check()
        t0 = time.monotonic()
        svc.request(0, torch.tensor([1], dtype=torch.int32), torch.tensor([0], dtype=torch.int32))
        assert time.monotonic() - t0 < 2  # sticky: later requests return at once
        with pytest.raises(SsdError):
            svc.check()


def test_gpu_gives_up_when_the_host_does_not_answer(ckpt):
    svc, bufs = _service(ckpt, io=FakeFaultyIO(then="slow", delay_s=1.0), wait_timeout_s=0.05)
    with svc:
        svc.request(0, torch.tensor([2], dtype=torch.int32), torch.tensor([1], dtype=torch.int32))
        assert int(svc.box[mb.GPU_ERROR]) == mb.GPU_TIMED_OUT == int(svc.error_flag[0])
        with pytest.raises(SsdError, match="the GPU waited 0.05 s and SSD reads did not finish"):
            svc.check()
        time.sleep(1.1)  # the slow read lands meanwhile; the tier stays failed
        with pytest.raises(SsdError):
            svc.check()


def test_all_padding_request_does_not_wait(ckpt):
    svc, _ = _service(ckpt, wait_timeout_s=30.0)
    with svc:
        t0 = time.monotonic()
        svc.request(0, torch.full((4,), -1, dtype=torch.int32), torch.full((4,), -1, dtype=torch.int32))
        svc.check()
        assert time.monotonic() - t0 < 5


def test_more_requests_than_the_mailbox_holds_are_refused(ckpt):
    svc, _ = _service(ckpt)
    with svc, pytest.raises(ValueError, match="exceed the mailbox's 8"):
        svc.request(0, torch.zeros(9, dtype=torch.int32), torch.zeros(9, dtype=torch.int32))


def test_request_kernel_compiles_for_hopper_with_system_scope_ordering():
    """The GPU build of the kernels (request, and read-ahead's post and settle; not the interpreter's)
    compiles for sm_90 with ptxas, using acquire/release at sys scope."""
    code = (
        "from triton.backends.compiler import GPUTarget\n"
        "from triton.compiler import ASTSource\n"
        "import triton\n"
        "from bigmoe_pager.core import ssd_mailbox as mb\n"
        "sig = {'box': '*i64', 'seq_ptr': '*i64', 'flag_ptr': '*i64', 'experts_ptr': '*i32', 'slots_ptr': '*i32',"
        " 'rows_ptr': '*i64', 'posted_ptr': '*i64', 'layer': 'i32', 'n': 'i32', 'nrows': 'i32', 'post_entry0': 'i32',"
        " 'timeout_ns': 'i64', 'max_spins': 'i32', 'DONE': 'constexpr', 'HURRY': 'constexpr', 'BLOCK': 'constexpr',"
        " 'ON_GPU': 'constexpr'}\n"
        "consts = {'DONE': mb.done_base(64), 'HURRY': mb.hurry_base(64), 'BLOCK': 64, 'ON_GPU': True}\n"
        "src = ASTSource(mb.request_kernel, sig, constexprs=consts)\n"
        "target = GPUTarget('cuda', 90, 32)\n"
        "k = triton.compile(src, target=target, options={'num_warps': 1})\n"
        "print(k.asm['ptx'])\n"
        "sig = {'box': '*i64', 'post_seq_ptr': '*i64', 'posted_ptr': '*i64', 'experts_ptr': '*i64',"
        " 'slots_ptr': '*i64', 'layer': 'i32', 'n': 'i32', 'entry0': 'i32',"
        " 'BLOCK': 'constexpr', 'ON_GPU': 'constexpr'}\n"
        "src = ASTSource(mb.post_kernel, sig, constexprs={'BLOCK': 64, 'ON_GPU': True})\n"
        "print(triton.compile(src, target=target, options={'num_warps': 1}).asm['ptx'])\n"
        "sig = {'box': '*i64', 'posted_ptr': '*i64', 'n': 'i32', 'done0': 'i32',"
        " 'BLOCK': 'constexpr', 'ON_GPU': 'constexpr'}\n"
        "src = ASTSource(mb.settle_kernel, sig, constexprs={'BLOCK': 128, 'ON_GPU': True})\n"
        "print(triton.compile(src, target=target, options={'num_warps': 1}).asm['ptx'])\n"
    )
    env = {**os.environ, "TRITON_INTERPRET": "0", "PYTHONPATH": str(ROOT / "pager")}
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    ptx = r.stdout
    assert "ld.acquire.sys.global.b64" in ptx and "st.release.sys.global.b64" in ptx and "%globaltimer" in ptx
    assert ptx.count(".visible .entry") == 3  # post_kernel and settle_kernel compiled too
