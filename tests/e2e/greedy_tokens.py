"""Run real vLLM (CPU build) in this process on a checkpoint and print greedy token ids as JSON.

Used by the e2e tests in a fresh process per configuration, because the plugin's registration is per
process. The BIGMOE_* environment decides whether the pager is on and how it is set up.
usage: python greedy_tokens.py MODEL_DIR MAX_TOKENS PROMPT [PROMPT ...]
       python greedy_tokens.py --fork-server     (vllm_runs.py: one fresh fork per run, imports done once)

The fork server imports vLLM once (about 15 s of one core here), then forks a child per run: the child
takes the run's environment, runs `main` as the plain command would, runs the exit handlers an interpreter
runs at exit, and ends. vLLM's plugins are loaded by the engine the child builds, never in the server
(checked before the first fork), so each run registers the plugin under its own settings exactly as a new
process does.
"""

import atexit
import ctypes
import gc
import json
import os
import signal
import sys
import tempfile
import time
import traceback


def engine_defaults() -> None:
    """The engine in this process (no engine-core subprocess), and quiet unless a run asks otherwise."""
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")


engine_defaults()
RUN_TIMEOUT_S = 600  # one run's limit, as the tests' subprocess.run timeout


def main(argv: list[str]) -> None:
    from vllm import LLM, SamplingParams

    model, max_tokens, prompts = argv[0], int(argv[1]), argv[2:]
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
    print("ENGINE_FACTS " + json.dumps(engine_facts()), flush=True)


def engine_facts() -> dict:
    """The pager's facts about this engine (bigmoe_pager.adapters.vllm.process.engine_facts; {} when it is off)."""
    if "bigmoe_pager.adapters.vllm.process" not in sys.modules:
        return {}
    return sys.modules["bigmoe_pager.adapters.vllm.process"].engine_facts()


def rss_anon_kb() -> int:
    """Anonymous resident memory of this process (kB): weights we hold, not file pages mapped, nor the free
    memory glibc's allocator keeps in its arenas (malloc_trim gives those pages back first)."""
    gc.collect()
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    for line in open("/proc/self/status"):
        if line.startswith("RssAnon:"):
            return int(line.split()[1])
    return -1


# ---- the fork server ------------------------------------------------------------------------------------


def serve() -> None:
    """Answer JSON lines {"argv": [...], "env": {...}} on stdin with {"returncode", "stdout", "stderr"} on stdout."""
    replies = os.fdopen(os.dup(1), "w")  # the answers' own channel: whatever an import prints goes to stderr
    os.dup2(2, 1)
    import vllm.plugins
    from vllm import LLM, SamplingParams  # noqa: F401  (the imports every run would make)

    if vllm.plugins.plugins_loaded or any(name.startswith("bigmoe_pager.adapters") for name in sys.modules):
        print(json.dumps({"refused": "vLLM's plugins were loaded before the first fork"}), file=replies, flush=True)
        return
    print(json.dumps({"ready": True}), file=replies, flush=True)
    for line in sys.stdin:
        request = json.loads(line)
        print(json.dumps(_forked_run(request["argv"], request["env"])), file=replies, flush=True)


def _forked_run(argv: list[str], env: dict[str, str]) -> dict:
    sys.stdout.flush()
    sys.stderr.flush()
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        pid = os.fork()
        if pid == 0:
            os._exit(_child(argv, env, out.fileno(), err.fileno()))
        code, late = _wait(pid, RUN_TIMEOUT_S)
        out.seek(0)
        err.seek(0)
        return {
            "returncode": code,
            "stdout": out.read().decode(errors="replace"),
            "stderr": err.read().decode(errors="replace") + late,
        }


def _wait(pid: int, timeout_s: float) -> tuple[int, str]:
    """The child's exit code; killed (and said so) once it has run timeout_s."""
    deadline = time.monotonic() + timeout_s
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return os.waitstatus_to_exitcode(status), ""
        if time.monotonic() > deadline:
            os.kill(pid, signal.SIGKILL)
            _, status = os.waitpid(pid, 0)
            return os.waitstatus_to_exitcode(status), f"\ngreedy_tokens: killed after {timeout_s:g} s"
        time.sleep(0.05)


def _child(argv: list[str], env: dict[str, str], out: int, err: int) -> int:
    """The run as a new process would make it: its own environment and standard streams, then main."""
    os.dup2(out, 1)
    os.dup2(err, 2)
    sys.stdin = open(os.devnull)
    os.environ.clear()
    os.environ.update(env)
    engine_defaults()
    try:
        main(argv)
        code = 0
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else 1
    except BaseException:
        traceback.print_exc()
        code = 1
    atexit._run_exitfuncs()  # what an interpreter's exit runs (the plugin writes BIGMOE_TRACE_PATH there)
    sys.stdout.flush()
    sys.stderr.flush()
    return code


if __name__ == "__main__":
    if sys.argv[1:] == ["--fork-server"]:
        serve()
    else:
        main(sys.argv[1:])
