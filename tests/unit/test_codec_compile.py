"""The codec's decode kernel compiles for Hopper as the H200 runs it, at full occupancy, for each kernel shape.

Compiled in a subprocess without TRITON_INTERPRET (target sm_90a, what Triton picks for
compute capability 9.0), then assembled by the ptxas Triton ships, whose -v report gives
registers and spills. 32 registers per thread lets 64 warps share an SM (65536 registers):
the decode loop is latency bound, so occupancy is its throughput.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

SCRIPT = r"""
import json, os, re, subprocess, sys, tempfile, triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from bigmoe_pager.codec import format as F, triton_decode as td

k = td._expand_kernel
ptrs = {"staging": "*u8", "work": "*i64", "errors": "*i32", "dst0": "*u8", "dst1": "*u8", "dst2": "*u8", "dst3": "*u8"}
g = F.Geometry.parse(sys.argv[4])
consts = dict(CODED0=True, CODED1=True, CODED2=False, CODED3=False, ALIGNED0=True, ALIGNED1=True, ALIGNED2=True,
              ALIGNED3=True, LANES=g.lanes, STEPS=g.lane_steps, CHUNK=g.chunk_symbols, HDR=g.chunk_header_bytes,
              MAX_TABLES=F.MAX_TABLES, PAD_WORDS=F.STREAM_PAD_WORDS, MAGIC=td._MAGIC_U32, GEOMETRY=g.word,
              ALIGN=F.STAGING_ALIGN, RAW_STEP=td.RAW_STEP)
ptxas = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")
block, warps, prefetch = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3] == "1"
c = dict(consts, BLOCK=block, PREFETCH=prefetch)
sig = {n: "constexpr" if n in c else ptrs.get(n, "i32") for n in k.arg_names}
attrs = {(k.arg_names.index(n),): [["tt.divisibility", 16]] for n in ptrs}
ck = triton.compile(ASTSource(k, sig, constexprs=c, attrs=attrs), target=GPUTarget("cuda", 90, 32),
                   options={"num_warps": warps})
with tempfile.TemporaryDirectory() as d:
    src = os.path.join(d, "k.ptx")
    open(src, "w").write(ck.asm["ptx"])
    r = subprocess.run([ptxas, "-arch=sm_90a", "-v", src, "-o", os.path.join(d, "k.cubin")],
                       capture_output=True, text=True)
print(json.dumps({"rc": r.returncode, "log": r.stderr[-2000:],
                  "regs": [int(x) for x in re.findall(r"Used (\d+) registers", r.stderr)],
                  "spill": [int(x) for x in re.findall(r"(\d+) bytes spill", r.stderr)]}))
"""


@pytest.mark.parametrize(
    "block,warps,prefetch,geometry",
    # the default shape, both loops; then one lane a thread for the shorter-laned geometries of bench_codec.py
    [(8, 4, 1, "16x128"), (8, 4, 0, "16x128"), (4, 2, 1, "16x128"), (2, 4, 1, "64x32"), (1, 4, 1, "128x16")],
)
def test_decode_kernel_compiles_for_sm90_without_spills_at_full_occupancy(block, warps, prefetch, geometry):
    env = {**os.environ, "TRITON_INTERPRET": "0", "PYTHONPATH": str(ROOT / "pager")}
    r = subprocess.run(
        [sys.executable, "-c", SCRIPT, str(block), str(warps), str(prefetch), geometry],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    got = json.loads(r.stdout.strip().splitlines()[-1])
    assert got["rc"] == 0, got["log"]
    assert got["regs"] and max(got["regs"]) <= 32, got["log"]
    assert not any(got["spill"]), got["log"]
