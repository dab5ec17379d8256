"""The FP8 tiny-moe checkpoint (Qwen's block-FP8 layout) loads and generates in real vLLM on a GPU.

vLLM's CPU build cannot run FP8 MoE without AMX, so this is where the FP8 layout
meets vLLM's own Fp8Config loader. On the H200, vLLM 0.25.1 is staged as
/work/shared/gpu-vllm/README.md describes (PYTHONPATH=/tmp/site VLLM_USE_FLASHINFER_SAMPLER=0).
"""

from __future__ import annotations

import gc

import pytest
import torch

pytestmark = pytest.mark.gpu

# Token ids, not text: the checkpoint is made without a tokenizer, so the test
# does not depend on the `tokenizers` package being on the GPU machine.
PROMPTS = [{"prompt_token_ids": [5, 17, 300, 42, 911, 7]}, {"prompt_token_ids": [1200, 64, 64, 3, 1800]}]


def test_vllm_loads_the_fp8_checkpoint_and_generates_varied_tokens(tiny_checkpoint, monkeypatch):
    if not torch.cuda.is_available():
        pytest.skip("no CUDA GPU")
    pytest.importorskip("vllm", reason="vLLM is not staged on this machine (see shared/gpu-vllm/README.md)")
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    monkeypatch.setenv("VLLM_PLUGINS", "")
    from vllm import LLM, SamplingParams

    model = tiny_checkpoint(dtype="fp8", seed=0, with_tokenizer=False)
    llm = LLM(
        model=str(model),
        max_model_len=512,
        max_num_seqs=2,
        enforce_eager=True,
        gpu_memory_utilization=0.1,
        seed=0,
        skip_tokenizer_init=True,
    )
    try:
        assert llm.llm_engine.model_config.quantization == "fp8"
        outputs = llm.generate(
            PROMPTS, SamplingParams(temperature=0.0, max_tokens=12, detokenize=False), use_tqdm=False
        )
    finally:
        del llm
        gc.collect()
    tokens = [list(o.outputs[0].token_ids) for o in outputs]
    assert all(len(t) == 12 for t in tokens), tokens
    assert len({tok for seq in tokens for tok in seq}) > 4 and tokens[0] != tokens[1], tokens
