"""The pager's Triton kernels compile for Hopper (sm_90, ptxas) as the GPU runs them, not only in the interpreter.

Compiled in a subprocess without TRITON_INTERPRET, with the alignment facts Triton's
launcher derives at run time (16-byte aligned pointers, pitches divisible by 16).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

SCRIPT = r"""
import json, re, triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from bigmoe_bench import moe_decode as md
from bigmoe_pager.core import acquire_kernel as ak, admit_kernel as adk, copy_kernel as ck, step_kernel as sk
from bigmoe_pager.core import replay_kernel as rk
from bigmoe_pager.core import prefetch_chain as chain
from bigmoe_pager.core import forward_rounds as fr
from bigmoe_pager.core import host_rounds as hr
from bigmoe_pager.core import ssd_mailbox as mb

def build(fn, sig, consts, aligned=()):
    full = dict(sig)
    full.update({k: "constexpr" for k in consts})
    attrs = {(fn.arg_names.index(n),): [["tt.divisibility", 16]] for n in aligned}
    return triton.compile(ASTSource(fn, full, constexprs=consts, attrs=attrs), target=GPUTarget("cuda", 90, 32),
                          options={"num_warps": 4})

def accesses(k, op):
    return sorted(set(re.findall(op + r"\.global[\.\w]*", k.asm["ptx"])))

out = {}
acq = {"ids_ptr": "*i32", "n_ids": "i32", "expert_slot_ptr": "*i64", "slot_expert_ptr": "*i64", "last_use_ptr": "*i64",
       "step_ptr": "*i64", "need_ptr": "*i32", "freq_ptr": "*i64", "remapped_ptr": "*i32", "miss_exp_ptr": "*i64",
       "miss_slot_ptr": "*i64", "evicted_ptr": "*i64", "counts_ptr": "*i64", "m": "i32", "stats_ptr": "*i64",
       "aux_ptr": "*i64", "record_bytes": "i32", "fast_ptr": "*i64", "slow_ptr": "*i64", "fast_held_ptr": "*u8",
       "fast_stamps_ptr": "*i64", "slow_held_ptr": "*u8", "slow_stamps_ptr": "*i64", "lru_held_ptr": "*u8",
       "lru_stamps_ptr": "*i64", "psel_ptr": "*i64", "psel_lru_ptr": "*i64", "psel_next_ptr": "*i64"}
POLICIES = {"lru": (False, False), "lfu": (True, False), "lfu-duel": (True, True)}  # name: (LFU, DUEL)
def policy(name):
    lfu, duel = POLICIES[name]
    return {"LFU": lfu, "DECAY": 16 if lfu else 0, "DUEL": duel, "SLOW_DECAY": 256 if duel else 0,
            "PSEL_MAX": 32 if duel else 0}
acq_only = {n: t for n, t in acq.items() if n in ak._acquire_kernel.arg_names}
for name in POLICIES:
    k = build(ak._acquire_kernel, acq_only, {"E": 512, "S": 205, "NEEDED": ak.NEEDED_KEY, "PACKED_MAX": ak.PACKED_MAX,
              "BLOCK_E": 512, "BLOCK_S": 256, "BLOCK_N": 256, "HAS_STATS": True, "HAS_AUX": True} | policy(name))
    out[f"acquire_{name}"] = "bar.sync" in k.asm["ptx"]
adm = {n: ("*i64" if n.endswith("_ptr") else "i32") for n in adk.decide_round.arg_names if n.islower()}
adm |= {"pred_ptr": "*i64", "want_ptr": "*i32", "avail_ptr": "*u8", "keep_ptr": "*u8"}
for lfu in (False, True):  # Flash-Next at 40% VRAM, every optional input present
    k = build(adk.decide_round, adm, {"E": 512, "S": 205, "NEEDED": ak.NEEDED_KEY, "PACKED_MAX": ak.PACKED_MAX,
              "BLOCK_E": 512, "BLOCK_S": 256, "BLOCK_N": 256, "HAS_AVAIL": True, "HAS_KEEP": True,
              "HAS_SOURCE": True, "HAS_STATS": True, "LFU": lfu, "BUDGET": 2, "SYNC": lfu, "ON_GPU": True})
    out[f"admit_lfu={lfu}"] = {"bar": "bar.sync" in k.asm["ptx"], "atom": accesses(k, "atom"),
                               "release": accesses(k, "st.release.gpu")}
step = {n: t for n, t in acq.items() if n != "need_ptr"} | {"done_ptr": "*i32", "programs": "i32", "rec_ptr": "*i64",
        "pitch_words": "i32", "out0": "*i64", "out1": "*i64", "out2": "*i64", "out3": "*i64", "chain_ptr": "*i64",
        "chain_layer": "i32", "claim_ptr": "*i64", "copied_ptr": "*i64", "target_ptr": "*i64",
        "filled_ptr": "*i64", "max_spins": "i32"}
step = {n: step[n] for n in sk._step_kernel.arg_names if n in step}
for name in POLICIES:  # Flash-Next at 40% VRAM: 512 experts, 205 slots, top-10
    k = build(sk._step_kernel, step, {"E": 512, "S": 205, "PACKED_MAX": ak.PACKED_MAX, "BLOCK_E": 512, "BLOCK_S": 256,
              "BLOCK_I": 16, "HAS_STATS": True, "HAS_AUX": True, **policy(name),
              "CHAIN": {"lru": 2, "lfu": 0, "lfu-duel": 1}[name], "SYNC": name == "lfu-duel", "ON_GPU": True,
              "OFF0": 0, "OFF1": 409600, "OFF2": 614400, "OFF3": 614504,
              "N0": 409600, "N1": 204800, "N2": 100, "N3": 50,
              "NB0": 400, "NB1": 200, "NB2": 1, "NB3": 1, "NBLK": 602, "BLOCK": 1024},
              ["rec_ptr", "pitch_words", "out0", "out1", "out2", "out3"])
    ptx = k.asm["ptx"]
    out[f"step_{name}"] = {"bar": "bar.sync" in ptx, "atom": accesses(k, "atom"),
                              "release": accesses(k, "st.release.gpu"), "acquire": accesses(k, "ld.acquire.gpu"),
                              "sleep": "nanosleep" in ptx,
                              "copy": sorted(set(re.findall(r"ld\.global[\.\w:]*\.v2\.b64", ptx))) + accesses(k, "st"),
                              "release_sys": accesses(k, "st.release.sys")}
box = {n: "*i64" for n in ("box", "seq_ptr", "flag_ptr", "experts_ptr", "slots_ptr", "rows_ptr", "posted_ptr")}
box |= {"layer": "i32", "n": "i32", "nrows": "i32", "post_entry0": "i32", "timeout_ns": "i64", "max_spins": "i32"}
k = build(mb.request_kernel, box, {"DONE": 72, "HURRY": 80, "BLOCK": 16, "ON_GPU": True})
out["mailbox"] = {"acquire": accesses(k, "ld.acquire.sys"), "release": accesses(k, "st.release.sys"),
                  "sleep": "nanosleep" in k.asm["ptx"]}
k = build(chain._wait_kernel, {"flags_ptr": "*i64", "layer": "i32", "max_spins": "i32"}, {"ON_GPU": True})
out["chain_wait"] = {"acquire": accesses(k, "ld.acquire.gpu"), "sleep": "nanosleep" in k.asm["ptx"]}
ptrs = ["rec_ptr", "src_ptr", "dst_ptr", "out0", "out1", "out2", "out3"]
def wide_copy(k):
    return sorted(set(re.findall(r"ld\.global[\.\w:]*\.v2\.b64", k.asm["ptx"]))) + accesses(k, "st")
for count in (False, True):  # a joinless round's copy counts each program's blocks into the slot's word
    k = build(ck._copy_kernel, {n: "*i64" for n in ptrs[:3]} | {"pitch_words": "i32"} | {n: "*i64" for n in ptrs[3:]}
              | {"copied_ptr": "*i64"},
              {"OFF0": 0, "OFF1": 262144, "OFF2": 393216, "OFF3": 393224, "N0": 262144, "N1": 131072, "N2": 8,
               "N3": 8, "NB0": 256, "NB1": 128, "NB2": 1, "NB3": 1, "BLOCK": 1024, "COUNT": count},
              ptrs + ["pitch_words"])
    out[f"copy_count={count}"] = {"copy": wide_copy(k), "atom": accesses(k, "atom")}
rounds = {n: "i32" for n in fr._forward_rounds_kernel.arg_names if n.islower()}
rounds |= {"table_ptr": "*i64", "flags_ptr": "*i64", "predicted_ptr": "*i32", "cursor_ptr": "*i64",
           "mailbox_ptr": "*i64"}
for host in (False, True):  # copied by its programs / published to the host copier
    k = build(fr._forward_rounds_kernel, rounds, {"FIELDS": len(fr.FIELDS), "WORD": triton.language.int64, "P": 8,
              "E": 256, "S": 102, "NEEDED": ak.NEEDED_KEY, "PACKED_MAX": ak.PACKED_MAX, "BLOCK_E": 256,
              "BLOCK_S": 128, "BLOCK_N": 256, "BLOCK_P": 8, "LFU": True, "BUDGET": 1, "ON_GPU": True,
              "OFF0": 0, "OFF1": 131072, "OFF2": 196608, "OFF3": 196672, "N0": 131072, "N1": 65536, "N2": 64,
              "N3": 32, "NB0": 128, "NB1": 64, "NB2": 1, "NB3": 1, "NBLK": 194, "BLOCK": 1024, "HOST": host,
              "BOX": 3 + 3 * 102})  # a 40-layer bench layer's shape
    out["forward_rounds" + ("_host" if host else "")] = {
        "acquire": accesses(k, "ld.acquire.gpu"),
        "release": accesses(k, "st.release.gpu") + accesses(k, "st.release.sys"),
        "atom": accesses(k, "atom"), "sleep": "nanosleep" in k.asm["ptx"], "bar": "bar.sync" in k.asm["ptx"]}
k = build(hr._drain_kernel, {"words_ptr": "*i64", "layers": "i32", "flags_ptr": "*i64", "max_spins": "i32"},
          {"S": 102, "BLOCK_S": 128, "ON_GPU": True})
out["drain"] = {"acquire": accesses(k, "ld.acquire.gpu"), "sleep": "nanosleep" in k.asm["ptx"]}
k = build(hr._publish_kernel, {"box_ptr": "*i64", "flags_ptr": "*i64", "rows_ptr": "*i64", "slot_ptr": "*i64",
          "target_ptr": "*i64", "m": "i32"}, {"S": 102, "BLOCK_S": 128, "ON_GPU": True})
out["publish"] = accesses(k, "st.release.sys")
replay = {n: "i32" for n in rk._replayed_rows_kernel.arg_names if n.islower()}
replay |= {"pred_ptr": "*i32", "cursor_ptr": "*i64", "out_ptr": "*i64"}
k = build(rk._replayed_rows_kernel, replay, {"P": 8, "BLOCK": rk.BLOCK})  # a trace's int32 ids, P = top-8
out["replay"] = accesses(k, "ld") + accesses(k, "st")
up = {"x_ptr": "*bf16", "ids_ptr": "*i32", "w_ptr": "*fp8e4nv", "s_ptr": "*fp32", "h_ptr": "*fp32",
      "w_stride": "i64", "s_stride": "i64"}
k = build(md._up_kernel, up, {"K": 10, "H": 2560, "I": 640, "SB": 128, "SC": 20, "BN": 16, "BK": 128}, list(up))
out["up"] = accesses(k, "ld")
down = {"h_ptr": "*fp32", "ids_ptr": "*i32", "w_ptr": "*fp8e4nv", "s_ptr": "*fp32", "y_ptr": "*fp32",
        "w_stride": "i64", "s_stride": "i64"}
k = build(md._down_kernel, down, {"H": 2560, "I": 640, "SB": 128, "SC": 5, "BN": 16, "BK": 128}, list(down))
out["down"] = accesses(k, "ld")
k = build(md._combine_kernel, {"y_ptr": "*fp32", "w_ptr": "*fp32", "out_ptr": "*fp32"}, {"K": 10, "H": 2560, "BH": 512})
out["combine"] = accesses(k, "st")
import gpu_launch_gap_probe as gp
for variant, mode in sorted(gp.POLL_MODES.items()):
    k = build(gp._side_kernel, {"flag_ptr": "*i64", "host_ptr": "*i64", "word_ptr": "*i64", "target": "i32",
              "max_spins": "i32"}, {"MODE": mode, "ON_GPU": True})
    out[f"gap_probe_{variant}"] = {"acquire": accesses(k, "ld.acquire.gpu") + accesses(k, "ld.acquire.sys"),
                                   "release": accesses(k, "st.release.sys"), "atom": accesses(k, "atom"),
                                   "sleep": "nanosleep" in k.asm["ptx"]}
print(json.dumps(out))
"""


def test_kernels_compile_for_sm90_with_wide_accesses():
    path = os.pathsep.join(str(ROOT / d) for d in ("pager", "bench", "scripts"))
    env = {**os.environ, "TRITON_INTERPRET": "0", "PYTHONPATH": path}
    r = subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    got = json.loads(r.stdout.strip().splitlines()[-1])
    assert got["acquire_lru"] and got["acquire_lfu"] and got["acquire_lfu-duel"]  # one program, block barriers
    # the admit kernel: one program with block barriers; a joinless round's (lfu here) claims the table (an acq_rel
    # max) and releases its decision with a release store at GPU scope; the other touches neither
    plain, joinless = got["admit_lfu=False"], got["admit_lfu=True"]
    assert (
        plain["bar"]
        and joinless["bar"]
        and plain["release"] == []
        and joinless["release"] == ["st.release.gpu.global.b64"]
    )
    assert not any("max" in a for a in plain["atom"]) and "atom.global.gpu.acq_rel.max.s64" in joinless["atom"]
    for count in (False, True):  # 16-byte copies; a counting copy adds its share with a release atomic
        copy = got[f"copy_count={count}"]
        assert any(".v2.b64" in a for a in copy["copy"] if a.startswith("ld")) and "st.global.v2.b64" in copy["copy"]
        assert copy["atom"] == (["atom.global.gpu.release.add.u64"] if count else [])
    assert "ld.global.v4.b32" in got["up"] and "ld.global.v4.b32" in got["down"]  # FP8 weights read 16 bytes at a time
    assert got["combine"]
    assert got["replay"] and any(a.startswith("st.global") for a in got["replay"])  # the replayed rows' gather
    for name in ("lru", "lfu", "lfu-duel"):  # the fused step: block barriers, an acq_rel done counter, 16-byte copies
        step = got[f"step_{name}"]
        assert step["bar"] and "atom.global.gpu.acq_rel.add.u32" in step["atom"]
        assert any("evict_first" in a for a in step["copy"]) and "st.global.v2.b64" in step["copy"]
        # a chained step publishes with a release store at GPU scope (lru here); the others store nothing so
        assert step["release"] == (["st.release.gpu.global.b64"] if name != "lfu" else [])
        # a joinless step (lfu-duel here) settles its round: a compare-and-swap, acquire loads of the claim and the
        # copies' progress, sleeps between polls; the others poll nothing
        assert ("atom.global.acq_rel.gpu.cas.b64" in step["atom"]) == (name == "lfu-duel")
        assert step["acquire"] == (["ld.acquire.gpu.global.b64"] if name == "lfu-duel" else [])
        assert step["sleep"] == (name == "lfu-duel")
        assert step["release_sys"] == []  # no step publishes to the host
    assert got["chain_wait"] == {"acquire": ["ld.acquire.gpu.global.b64"], "sleep": True}  # polls, sleeping between
    # the one-node rounds: poll the steps' and the claims' words (acquire, sleeping), claim with an acq_rel max,
    # release each decision, count each program's copied blocks with a release add; block barriers between phases
    rounds = got["forward_rounds"]
    assert rounds["acquire"] == ["ld.acquire.gpu.global.b64"] and rounds["sleep"] and rounds["bar"]
    assert rounds["release"] == ["st.release.gpu.global.b64"]
    assert "atom.global.gpu.acq_rel.max.s64" in rounds["atom"] and "atom.global.gpu.release.add.u64" in rounds["atom"]
    # published to the host copier: the decision's release at GPU scope, the mailbox's sequence word at system scope
    # (the host is the other end); no program counts copies
    host = got["forward_rounds_host"]
    assert host["release"] == ["st.release.gpu.global.b64", "st.release.sys.global.b64"]
    assert "atom.global.gpu.release.add.u64" not in host["atom"] and host["sleep"]
    # a forward's drain of the host's copies: acquire loads of their progress, sleeping between polls
    assert got["drain"] == {"acquire": ["ld.acquire.gpu.global.b64"], "sleep": True}
    assert got["publish"] == ["st.release.sys.global.b64"]  # a pager's round, published to the host copier
    # the SSD mailbox's request: acquire loads and release stores at system scope (the host is the other end)
    assert got["mailbox"] == {
        "acquire": ["ld.acquire.sys.global.b64"],
        "release": ["st.release.sys.global.b64"],
        "sleep": True,
    }
    # the launch-gap probe's side kernels (scripts/gpu_launch_gap_probe.py) poll as the pager's waits do, each with
    # the one extra memory habit it is named for
    gpu_acquire = "ld.acquire.gpu.global.b64"
    assert got["gap_probe_spin"] == {"acquire": [gpu_acquire], "release": [], "atom": [], "sleep": True}
    assert got["gap_probe_outside-spin"] == got["gap_probe_spin"]
    assert got["gap_probe_spin-hard"] == {"acquire": [], "release": [], "atom": [], "sleep": False}
    assert got["gap_probe_spin-sys"]["acquire"] == [gpu_acquire, "ld.acquire.sys.global.b64"]
    assert got["gap_probe_store-sys"]["release"] == ["st.release.sys.global.b64"]
    assert got["gap_probe_atomics"]["atom"] and got["gap_probe_atomics"]["sleep"]
