"""The expert pager inside real vLLM (CPU build): same greedy tokens as the unpaged
model in every tier mix, pager series in /metrics, less memory when experts leave RAM.
Each configuration runs in its own process: the plugin registers per process."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

pytestmark = pytest.mark.e2e
vllm = pytest.importorskip("vllm", reason="real vLLM (installer/install.sh) is needed for e2e tests")

from vllm_runs import greedy_run  # noqa: E402

PROMPTS = [
    "The sea is calm and the boats are",
    "Write a short note about the river",
    "one two three four five six seven",
    "A green tree stands near the old house because",
]
LONG_PROMPT = " ".join(["the blue river runs past the old stone house and the tall green tree"] * 40)


def greedy(model: Path, env: dict[str, str], prompts=PROMPTS, max_tokens: int = 64, facts: list | None = None):
    """(greedy token ids per prompt, anonymous RSS in kB) of one engine run; its engine facts (the pager's
    process.engine_facts) are appended to `facts` when given."""
    full = {k: v for k, v in os.environ.items() if not k.startswith("BIGMOE_")}
    full.update(env)
    proc = greedy_run(model, max_tokens, list(prompts), full)
    lines = proc.stdout.splitlines()
    tokens = [l for l in lines if l.startswith("TOKENS ")]
    assert proc.returncode == 0 and tokens, f"vLLM run failed:\n{proc.stderr[-3000:]}"
    rss = [int(l.split()[1]) for l in lines if l.startswith("RSS_ANON_KB ")]
    if facts is not None:
        facts.extend(json.loads(l[len("ENGINE_FACTS ") :]) for l in lines if l.startswith("ENGINE_FACTS "))
    return json.loads(tokens[0][7:]), rss[0]


def routed_expert_bytes(model: Path) -> tuple[int, int, int]:
    """(bytes of one routed expert in the checkpoint, experts per layer, MoE layers), from its headers."""
    from safetensors import safe_open

    per_expert, experts, layers = 0, set(), set()
    for path in model.glob("*.safetensors"):
        with safe_open(str(path), framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 (safe_open has no __iter__)
                parts = name.split(".")
                if "experts" not in parts or parts[parts.index("experts") + 1] in ("gate", "gate_up_proj"):
                    continue
                layer, expert = parts[parts.index("layers") + 1], parts[parts.index("experts") + 1]
                layers.add(layer)
                experts.add(expert)
                if layer == "0" and expert == "0":
                    per_expert += f.get_tensor(name).nbytes
    return per_expert, len(experts), len(layers)


SHAPES = {
    "tiny-moe": dict(),  # the preset's shape: 4 layers x 16 experts, top-4, 256/128
    "wide": dict(layers=2, experts=24, top_k=6, hidden=128, moe_intermediate=64),
}

MODES = {
    "all-in-slots": {"BIGMOE_PAGER": "1"},
    "vram<experts, all in RAM": {"BIGMOE_PAGER": "1", "BIGMOE_VRAM_SLOTS": "6"},
    "vram<ram<experts, SSD = checkpoint": {"BIGMOE_PAGER": "1", "BIGMOE_VRAM_SLOTS": "6", "BIGMOE_RAM_SLOTS": "9"},
}


class ComputedOnce(dict):
    """A dict whose missing keys are computed by `compute(key)` when first asked for, then kept."""

    def __init__(self, compute):
        super().__init__()
        self.compute = compute

    def __missing__(self, key):
        self[key] = value = self.compute(key)
        return value


@pytest.fixture(scope="session")
def shapes(tiny_checkpoint):
    tiny = sys.modules["make_tiny_moe"]
    return {name: tiny_checkpoint(tiny.TinyShape(**kw), "bf16", seed=3) for name, kw in SHAPES.items()}


@pytest.fixture(scope="session")
def reference(shapes):
    """Greedy tokens of each model without the plugin (it stays off unless BIGMOE_PAGER=1), each made once per
    session and only where a test asks for it (an xdist worker that runs only one shape's cases runs one engine)."""
    return ComputedOnce(lambda name: greedy(shapes[name], {})[0])


@pytest.mark.parametrize("shape", list(SHAPES))
@pytest.mark.parametrize("mode", list(MODES))
def test_paged_tokens_equal_resident_tokens(shapes, reference, shape, mode):
    facts = []
    tokens, _ = greedy(shapes[shape], MODES[mode], facts=facts)
    assert tokens == reference[shape]
    assert len({tuple(t) for t in tokens}) > 1, "prompts should not all decode the same"
    # the engine reports what vLLM's loader copied into the RAM tier: every expert RAM holds, nothing SSD keeps
    per_expert, experts, layers = routed_expert_bytes(shapes[shape])
    in_ram = int(MODES[mode].get("BIGMOE_RAM_SLOTS", experts))
    assert facts and facts[0]["load_copy_bytes"] == layers * in_ram * per_expert
    assert facts[0]["prefetch_joins"] == []  # no CUDA graphs here
    assert facts[0]["step_kernels"] == {}  # no kernel compiled for a GPU either (Triton's interpreter, if any)


def test_compiled_engine_pages_through_an_opaque_op(shapes):
    """Without --enforce-eager vLLM's CPU build compiles the model; paging must stay outside the trace.
    Compiled and eager models round differently, so the reference is compiled too."""
    compiled = {"GREEDY_COMPILE": "1"}
    plain, _ = greedy(shapes["tiny-moe"], compiled)
    paged, _ = greedy(
        shapes["tiny-moe"], {**compiled, "BIGMOE_PAGER": "1", "BIGMOE_VRAM_SLOTS": "6", "BIGMOE_RAM_SLOTS": "9"}
    )
    assert paged == plain


def test_prompt_longer_than_slots_is_chunked_and_exact(shapes):
    model = shapes["tiny-moe"]
    plain, _ = greedy(model, {}, [LONG_PROMPT], max_tokens=16)
    paged, _ = greedy(
        model, {"BIGMOE_PAGER": "1", "BIGMOE_VRAM_SLOTS": "4", "BIGMOE_RAM_SLOTS": "8"}, [LONG_PROMPT], max_tokens=16
    )
    assert paged == plain


def _cpu_has_amx() -> bool:
    try:
        return "amx_tile" in open("/proc/cpuinfo").read()
    except OSError:
        return False


@pytest.mark.skipif(not _cpu_has_amx(), reason="vLLM's CPU build runs FP8 MoE only on CPUs with Intel AMX")
def test_fp8_experts_paged_in_through_the_ram_tier_give_the_same_tokens(tiny_checkpoint):
    """FP8 weights and 128x128 scales load into RAM records, then are VNNI-packed into slots at page-in.
    Every expert has a slot here: the CPU FP8 kernel's rounding depends on how many tokens share an
    expert in one call, so token-chunked prefill is exact only for the bf16 kernel (docs/pager.md)."""
    tiny = sys.modules["make_tiny_moe"]
    model = tiny_checkpoint(tiny.TinyShape(), "fp8", seed=3)
    plain, _ = greedy(model, {})
    paged, _ = greedy(model, {"BIGMOE_PAGER": "1"})
    assert paged == plain


def test_recorded_routing_trace_loads_in_the_benchmark_and_replays(shapes, tmp_path):
    """BIGMOE_TRACE_PATH writes the routing of a real run in the format bench_pager.py replays;
    BIGMOE_ROUTE_REPLAY (benchmark only) feeds it back identically."""
    from bigmoe_bench.traces import load_trace

    trace = tmp_path / "routing.npz"
    recorded, _ = greedy(
        shapes["tiny-moe"],
        {"BIGMOE_PAGER": "1", "BIGMOE_VRAM_SLOTS": "6", "BIGMOE_TRACE_PATH": str(trace)},
        max_tokens=16,
    )
    ids = load_trace(trace, experts=16)
    assert ids.dtype.name == "int32" and ids.shape[1:] == (4, 4)
    assert ids.shape[0] >= 4 * 16  # every prompt token and every generated token of the 4 requests
    assert ((ids >= 0) & (ids < 16)).all()
    replayed, _ = greedy(
        shapes["tiny-moe"],
        {
            "BIGMOE_PAGER": "1",
            "BIGMOE_VRAM_SLOTS": "6",
            "BIGMOE_ROUTE_REPLAY": str(trace),
            "BIGMOE_TRACE_PATH": str(tmp_path / "again.npz"),
        },
        max_tokens=16,
    )
    assert replayed == recorded  # replaying a run's own routing in the same order reproduces it
    again = load_trace(tmp_path / "again.npz", experts=16)
    assert (again == ids).all()
    # Pager off, routing still replayed (how the GPU benchmark drives resident and vLLM-offload runs alike).
    unpaged, _ = greedy(shapes["tiny-moe"], {"BIGMOE_ROUTE_REPLAY": str(trace)}, max_tokens=16)
    assert unpaged == recorded
    np.savez(tmp_path / "shifted.npz", topk_ids=(ids + 1) % 16)
    other, _ = greedy(shapes["tiny-moe"], {"BIGMOE_ROUTE_REPLAY": str(tmp_path / "shifted.npz")}, max_tokens=16)
    assert other != recorded  # the replayed ids, not the router's, decide the tokens
