"""One configuration of scripts/gpu_vllm_e2e.py (or gpu_vllm_bench.py): real vLLM in this process, greedy tokens
and timings.

    python scripts/vllm_e2e_child.py SPEC.json RESULT.json

A bench spec ("task": "bench") may list measurements (a routing trace each, swapped into the
running engine before it: Routing.load_replay) and the lock files by which the engines of one
call take turns to time (bench_all).

A fresh process per configuration, because the pager plugin registers per
process; the BIGMOE_* environment decides whether and how it pages. SPEC holds
the model directory, the prompts (text, or token-id lists), token counts and
engine sizes. RESULT gets the greedy token ids with the sampled tokens'
logprobs, batch-1 wall times and the pager's counters; it is written (whole,
via a temporary name) only when every step ran, so a failed run leaves none.
No textual/httpx/click: this runs on the GPU machine from a checkout.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # the engine in this process: its layers are readable here
os.environ.setdefault("VLLM_USE_FLASHINFER_SAMPLER", "0")  # FlashInfer is not staged on the H200


def main(spec_path: str, result_path: str) -> None:
    spec = json.loads(Path(spec_path).read_text())
    started = time.perf_counter()
    if spec.get("deterministic"):
        deterministic()
    quiet = Lock(spec.get("quiet_file"))
    quiet.take(shared=True)  # engines starting hold it shared; a timed request of another engine waits them out
    with _startup_stacks(spec, result_path):
        llm = _engine(spec)
    quiet.release()
    startup_s = time.perf_counter() - started - quiet.waited_s
    result = {
        "vllm": _vllm_version(),
        "startup_s": round(startup_s, 2),
        "cudagraph_mode": _cudagraph_mode(llm),
        "inductor_deterministic": _inductor_deterministic(),
    }
    if spec.get("task", "identity") == "bench":
        result.update(bench_all(llm, spec, quiet))
    else:
        detokenize = not spec["skip_tokenizer_init"]
        result["short"] = greedy(llm, spec["prompts"], spec["max_tokens"], detokenize)
        result["serial"] = serial(llm, spec["prompts"], spec["max_tokens"], detokenize)
        result["long"] = greedy(llm, [spec["long_ids"]], spec["long_max_tokens"], detokenize)
        result.update(batch1_timing(llm, spec["timing_ids"], spec["warmup_ids"], spec["timing_tokens"]))
    result.update(pager=_pager_counters(), experts_kernel=_experts_kernel(), spec_decode=_spec_decode_counters(llm))
    result.update(_engine_facts())
    tmp = Path(result_path).with_suffix(".partial")
    tmp.write_text(json.dumps(result))
    tmp.replace(result_path)


def deterministic() -> None:
    """Make the engine reproduce itself between processes (before vLLM compiles anything).

    torch.compile times some candidate reduction kernels in each process and keeps the
    fastest; candidates sum in different orders, so two runs of one model can differ in
    the last bits and, many tokens later, in a greedy token. Inductor's deterministic
    mode skips that timing. Dynamo resets that mode to the deterministic-algorithms flag
    after every frame it compiles, so the flag itself is set (warn-only: ops without a
    deterministic kernel still run) and empty tensors keep their plain allocation.
    """
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    os.environ.setdefault("TORCHINDUCTOR_DETERMINISTIC", "1")
    import torch

    torch.use_deterministic_algorithms(True, warn_only=True)
    torch.utils.deterministic.fill_uninitialized_memory = False


def _engine(spec: dict):
    from vllm import LLM

    return LLM(
        model=spec["model"],
        dtype="bfloat16",
        max_model_len=spec["max_model_len"],
        max_num_seqs=spec.get("max_num_seqs", 8),
        max_num_batched_tokens=spec["max_model_len"],
        enforce_eager=spec.get("enforce_eager", True),
        enable_prefix_caching=False,
        seed=0,
        distributed_executor_backend="uni",
        skip_tokenizer_init=spec["skip_tokenizer_init"],
        disable_log_stats=False,  # request timestamps for TTFT/TPOT
        **_memory_args(spec),
        **_engine_extras(spec),
    )


def _startup_stacks(spec: dict, result_path: str):
    """With spec["stacks_dir"]: the engine start's main-thread stack every 10 s, to <config>-startup-stacks.txt."""
    if not spec.get("stacks_dir"):
        return contextlib.nullcontext()
    from bigmoe_bench.stack_sampler import StackSampler

    name = Path(result_path).name.removesuffix(".result.json")
    return StackSampler(Path(spec["stacks_dir"]) / f"{name}-startup-stacks.txt", period_s=10.0)


def _memory_args(spec: dict) -> dict:
    """KV cache sizing: a share of GPU memory, or a fixed size where there is no GPU (vLLM's CPU build)."""
    if spec.get("kv_cache_memory_bytes"):
        # vLLM still checks its memory share against the free memory at start: engines sharing a GPU ask a small one.
        share = {"gpu_memory_utilization": spec["gpu_memory_utilization"]} if spec.get("gpu_memory_utilization") else {}
        return {"kv_cache_memory_bytes": spec["kv_cache_memory_bytes"], **share}
    return {"gpu_memory_utilization": spec["gpu_memory_utilization"]}


def _engine_extras(spec: dict) -> dict:
    """CUDA-graph and vLLM-offload settings a spec may carry (absent: vLLM's defaults)."""
    extras = dict(spec.get("engine") or {})  # the model's own settings (graph mode, MTP's speculative_config)
    if spec.get("deterministic") and not spec.get("enforce_eager", True):
        # Inductor's combo-kernel fusion times candidate kernels, which its deterministic mode forbids.
        extras["compilation_config"] = {
            **extras.get("compilation_config", {}),
            "inductor_compile_config": {"combo_kernels": False, "benchmark_combo_kernel": False},
        }
    if spec.get("max_cudagraph_capture_size"):
        extras["max_cudagraph_capture_size"] = spec["max_cudagraph_capture_size"]
    if spec.get("cpu_offload_gb"):
        extras["cpu_offload_gb"] = spec["cpu_offload_gb"]
        extras["cpu_offload_params"] = set(spec["cpu_offload_params"])
    return extras


def _cudagraph_mode(llm) -> str:
    try:
        mode = llm.llm_engine.vllm_config.compilation_config.cudagraph_mode
    except AttributeError:
        return "unknown"
    return getattr(mode, "name", str(mode))


class Lock:
    """An flock on a file shared by the engines of one benchmark call (no file: a no-op), with the seconds waited."""

    def __init__(self, path: str | None):
        self.path = path
        self.waited_s = 0.0
        self._fd: int | None = None

    def take(self, shared: bool = False) -> None:
        import fcntl

        if self.path is None:
            return
        started = time.perf_counter()
        self._fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        fcntl.flock(self._fd, fcntl.LOCK_SH if shared else fcntl.LOCK_EX)
        self.waited_s += time.perf_counter() - started

    def release(self) -> None:
        if self._fd is not None:
            os.close(self._fd)  # closing the only descriptor releases the flock
            self._fd = None


def bench_all(llm, spec: dict, quiet: Lock) -> dict:
    """Every measurement of the spec (a routing trace each, swapped in before it) in this one engine.

    spec["measurements"]: [{"family", "recall", "wrong", "trace"}] (absent: one, with the trace the engine
    started with). Once the engine is up it takes the turn file's exclusive lock (spec["turn_file"])
    and holds it to the end, so no two engines of a call measure at once; each timed request also
    waits until no engine is starting (the quiet file, held shared during startup: weight loading and
    graph capture would share the GPU, PCIe and CPUs with the timing).
    """
    turn = Lock(spec.get("turn_file"))
    turn.take()
    out = []
    for m in spec.get("measurements") or [{}]:
        if m.get("trace"):
            from bigmoe_pager.adapters.vllm import process

            process.current().routing.load_replay(m["trace"])
        point = {k: m.get(k) for k in ("family", "recall", "wrong")}
        out.append({**point, **bench(llm, spec, quiet)})
    return {"measurements": out, "turn_wait_s": round(turn.waited_s, 2), "quiet_wait_s": round(quiet.waited_s, 2)}


def bench(llm, spec: dict, quiet: Lock | None = None) -> dict:
    """Batch-1 TTFT/TPOT of a long prompt, and the pager's counters per decoded token.

    A warm-up request of the timed shape runs first. The counters come from a request
    whose prompt is one token, so every step it makes is decode-shaped (one token's
    top-k ids); its deltas over its tokens are the per-token hit rates and bytes.
    Then the timed request (once no engine of the call is starting: `quiet`), with the counters'
    deltas over it (its prefill's SSD bytes are the disk floor of its TTFT).
    """
    from vllm import SamplingParams

    tokens = spec["timing_tokens"]
    params = SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True, detokenize=False)
    llm.generate([{"prompt_token_ids": spec["warmup_ids"]}], params, use_tqdm=False)
    before = _pager_counters()
    llm.generate([{"prompt_token_ids": spec["warmup_ids"][:1]}], params, use_tqdm=False)
    after = _pager_counters()
    decode = {tier: {k: after[tier][k] - before[tier][k] for k in after[tier]} for tier in after}
    quiet = quiet or Lock(None)
    quiet.take()
    before = _pager_counters()
    try:
        timing = batch1_timing(llm, spec["timing_ids"], None, tokens)
    finally:
        quiet.release()
    after = _pager_counters()
    timed = {tier: {k: after[tier][k] - before[tier][k] for k in after[tier]} for tier in after}
    profile = decode_profile(llm, spec, quiet)
    per_token = lambda tier: round(decode[tier]["bytes_moved"] / tokens / 1e9, 5) if decode else None  # noqa: E731
    return {
        **timing,
        "decode_counters": decode,
        "timed_counters": timed,
        "decode_tokens": tokens,
        "pcie_gb_per_token": per_token("ram"),
        "ssd_gb_per_token": per_token("ssd"),
        **({"decode_profile": profile} if profile else {}),
    }


def decode_profile(llm, spec: dict, quiet: Lock) -> dict | None:
    """spec["profile_tokens"] decode tokens (a one-token prompt) under torch.profiler's CUDA activity, summarized
    per stream (bigmoe_bench.kernel_timeline); the Chrome trace stays in spec["profile_dir"]. None when not asked."""
    tokens = spec.get("profile_tokens") or 0
    if not tokens:
        return None
    import torch
    from bigmoe_bench.kernel_timeline import summarize_file
    from vllm import SamplingParams

    out = Path(spec["profile_dir"])
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"decode-{os.getpid()}-{len(list(out.glob(f'decode-{os.getpid()}-*.json')))}.json"
    params = SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True, detokenize=False)
    cuda = torch.cuda.is_available()  # the CPU build's smoke run profiles CPU activity: no kernels to summarize
    activity = torch.profiler.ProfilerActivity.CUDA if cuda else torch.profiler.ProfilerActivity.CPU
    quiet.take()
    try:
        with torch.profiler.profile(activities=[activity]) as prof:
            llm.generate([{"prompt_token_ids": spec["warmup_ids"][:1]}], params, use_tqdm=False)
        prof.export_chrome_trace(str(path))
    except Exception as e:  # a diagnostic: the measurement above stands without it
        return {"error": f"profiling failed: {type(e).__name__}: {e}".splitlines()[0]}
    finally:
        quiet.release()
    return {"trace": str(path), **summarize_file(path, tokens)}


def greedy(llm, prompts: list, max_tokens: int, detokenize: bool) -> dict:
    """Greedy token ids and each sampled token's logprob, per prompt (ids as given or from vLLM's tokenizer)."""
    from vllm import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, logprobs=1, detokenize=detokenize)
    inputs = [p if isinstance(p, str) else {"prompt_token_ids": p} for p in prompts]
    started = time.perf_counter()
    outs = llm.generate(inputs, params, use_tqdm=False)
    seconds = time.perf_counter() - started
    tokens = [list(o.outputs[0].token_ids) for o in outs]
    return {
        "tokens": tokens,
        "logprobs": [_sampled_logprobs(o.outputs[0], t) for o, t in zip(outs, tokens)],
        "prompt_tokens": [len(o.prompt_token_ids or []) for o in outs],
        "seconds": round(seconds, 3),
    }


def serial(llm, prompts: list, max_tokens: int, detokenize: bool) -> dict:
    """The same prompts one request at a time: batch-1 decode, which no other request's rows share."""
    parts = [greedy(llm, [p], max_tokens, detokenize) for p in prompts]
    return {key: [v for part in parts for v in part[key]] for key in ("tokens", "logprobs", "prompt_tokens")}


def batch1_timing(llm, prompt_ids: list[int], warmup_ids: list[int], tokens: int) -> dict:
    """TTFT and TPOT of one request alone, from vLLM's own request timestamps (engine-core clock).

    TTFT = first token - scheduled; TPOT = (last token - first token) / (tokens - 1). A request of
    the same shape but another prompt runs first: one-time costs (kernel compiles) are not
    counted, and the pager's caches are not primed with the timed request's own experts.
    """
    from vllm import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True, detokenize=False)
    if warmup_ids is not None:
        llm.generate([{"prompt_token_ids": warmup_ids}], params, use_tqdm=False)
    started = time.perf_counter()
    out = llm.generate([{"prompt_token_ids": prompt_ids}], params, use_tqdm=False)[0]
    wall = time.perf_counter() - started
    m = out.metrics
    if m is None or not m.first_token_ts or m.num_generation_tokens != tokens:
        # Tokens are this run's result; a missing timestamp only leaves the timing out, said so.
        return {
            "ttft_ms": None,
            "tpot_ms": None,
            "request_wall_ms": round(wall * 1e3, 3),
            "timing_note": "vLLM gave no request timestamps",
        }
    return {
        "tokens": list(out.outputs[0].token_ids),
        "ttft_ms": round((m.first_token_ts - m.scheduled_ts) * 1e3, 3),
        "tpot_ms": round((m.last_token_ts - m.first_token_ts) / (tokens - 1) * 1e3, 3),
        "request_wall_ms": round(wall * 1e3, 3),
    }


def _sampled_logprobs(completion, token_ids: list[int]) -> list[float] | None:
    """Each sampled token's logprob, or None where this vLLM returned none (identity then not judged)."""
    entries = completion.logprobs
    if entries is None or len(entries) != len(token_ids):
        return None
    return [float(entries[i][tok].logprob) for i, tok in enumerate(token_ids)]


def _inductor_deterministic() -> bool | None:
    """torch.compile's deterministic mode (TORCHINDUCTOR_DETERMINISTIC=1): no timing-based choice of reduction
    kernels, whose pick changes summation order and so, between processes, the engine's own greedy tokens."""
    try:
        from torch._inductor import config
    except ImportError:
        return None
    return getattr(config, "deterministic", None)


def _spec_decode_counters(llm) -> dict | None:
    """vLLM's speculative-decoding counters over the whole run (drafts, draft tokens, accepted tokens), or None."""
    try:
        metrics = llm.get_metrics()
    except (AttributeError, AssertionError, RuntimeError):
        return None
    counts = {
        m.name.removeprefix("vllm:spec_decode_"): getattr(m, "value", None)
        for m in metrics
        if m.name.startswith("vllm:spec_decode_num_")
    }
    if not counts:
        return None
    drafted, accepted = counts.get("num_draft_tokens"), counts.get("num_accepted_tokens")
    counts["acceptance_rate"] = round(accepted / drafted, 4) if drafted and accepted is not None else None
    return counts


def _pager_counters() -> dict:
    from bigmoe_pager.adapters.vllm import process

    return process.pager_stats()


def _engine_facts() -> dict:
    from bigmoe_pager.adapters.vllm import process

    return process.engine_facts()


def _experts_kernel() -> str | None:
    from bigmoe_pager.adapters.vllm import process

    return process.experts_kernel_name()


def _vllm_version() -> str:
    import vllm

    return getattr(vllm, "__version__", "unknown")


if __name__ == "__main__":
    if len(sys.argv) != 3:
        sys.exit("usage: vllm_e2e_child.py SPEC.json RESULT.json")
    main(sys.argv[1], sys.argv[2])
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # the result is on disk; skip engine teardown, which can take seconds per configuration
