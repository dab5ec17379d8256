"""Run real vLLM (CPU build) in this process on a checkpoint and print greedy token ids as JSON.

Used by the e2e tests in a fresh subprocess per configuration, because the
plugin's registration is per process. The BIGMOE_* environment decides
whether the pager is on and how it is set up.
usage: python greedy_tokens.py MODEL_DIR MAX_TOKENS PROMPT [PROMPT ...]
"""

import gc
import json
import os
import sys

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")


def main() -> None:
    from vllm import LLM, SamplingParams

    model, max_tokens, prompts = sys.argv[1], int(sys.argv[2]), sys.argv[3:]
    llm = LLM(
        model=model,
        dtype="bfloat16",
        max_model_len=2048,
        max_num_seqs=8,
        distributed_executor_backend="uni",
        kv_cache_memory_bytes=256 << 20,
        enforce_eager=os.environ.get("GREEDY_COMPILE") != "1",
        seed=0,
        enable_prefix_caching=False,
        max_num_batched_tokens=2048,
    )
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    outs = llm.generate(prompts, params, use_tqdm=False)
    print("TOKENS " + json.dumps([list(o.outputs[0].token_ids) for o in outs]), flush=True)
    print("RSS_ANON_KB " + str(rss_anon_kb()), flush=True)


def rss_anon_kb() -> int:
    """Anonymous resident memory of this process (kB): weights we hold, not file pages mapped."""
    gc.collect()
    for line in open("/proc/self/status"):
        if line.startswith("RssAnon:"):
            return int(line.split()[1])
    return -1


if __name__ == "__main__":
    main()
