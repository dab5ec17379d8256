"""The expert pager inside real vLLM on a CUDA GPU: greedy tokens equal the unpaged model's in every tier mix.

    PYTHONPATH=/tmp/site:pager:app:bench VLLM_USE_FLASHINFER_SAMPLER=0 \\
        python3 scripts/gpu_vllm_e2e.py --out $OUT/vllm_gpu_e2e.json

(vLLM 0.25.1 and the project wheel staged into /tmp/site as shared/gpu-vllm/README.md says.)
Makes an FP8 synthetic Qwen3-MoE with Qwen3.6-35B-A3B's expert shapes (256 experts of
2048 -> 512, top-8, 128x128 block scales) but few layers, builds a compressed paging
file from it in the background, then runs vLLM's offline LLM once per configuration,
each in its own process (the plugin registers per process). Graph runs use vLLM's
default CUDA-graph mode with --max-cudagraph-capture-size 4 (32 slots / top-8: what the
device-driven pager needs so every captured batch fits the slots); the eager runs
(named so) are compared with an eager unpaged run, the PIECEWISE ones with a PIECEWISE one:

    unpaged                      the reference (CUDA graphs)
    unpaged-repeat               the same again: does the engine reproduce itself?
    vram40                       40% of experts in VRAM slots, all in pinned RAM (CUDA graphs, BIGMOE_CUDA_GRAPHS=1)
    vram12-ram50-ssd             12.5% in VRAM, 50% in RAM, the SSD tier reads the checkpoint (CUDA graphs)
    vram40-layerbuf              vram40 with big steps run over one whole-layer buffer (BIGMOE_PREFILL_BUFFER=1)
    vram12-ram50-ssd-layerbuf    vram12-ram50-ssd with that buffer (its experts gathered through the slots)
    vram40-predict               vram40 with the live next-layer predictor prefetching (BIGMOE_PREDICT=router)
    vram12-ram50-ssd-predict-ahead  vram12-ram50-ssd with that prefetch and SSD reads ahead (BIGMOE_SSD_READ_AHEAD=1)
    vram40-predict-chain         vram40-predict with each forward's rounds chained (BIGMOE_PREFETCH_CHAIN=1)
    vram40-predict-joinless      vram40-predict chained and joined once a forward (BIGMOE_PREFETCH_JOINLESS=1)
    vram40-predict-host          vram40-predict-joinless with its copies made by the host copier's thread through the
                                 copy engines (BIGMOE_PREFETCH_HOST_COPIER=1)
    vram40-predict-host-dist2    vram40-predict-host with each round two layers ahead (BIGMOE_PREFETCH_DISTANCE=2;
                                 needs --layers 3 or more to reach past the first layer's rounds)
    unpaged-piecewise            the reference of PIECEWISE runs (the graph mode alone changes the engine's numerics)
    vram40-piecewise             vram40 under PIECEWISE CUDA graphs
    vram40-predict-piecewise     vram40-predict under PIECEWISE CUDA graphs
    unpaged-eager                the reference of eager runs
    vram40-eager-device          the device-driven pager (BIGMOE_CUDA_GRAPHS=1) without graphs
    vram40-eager-host            the host-driven pager, eager
    vram12-ram50-ssd-codec       12.5% / 50%, the SSD tier reads a compressed paging file (eager)
    vram12-ram50-ssd-codec-graphs  the same under CUDA graphs (the device-driven pager; records expanded on the CPU)

Each greedily decodes 4 prompts x 128 tokens (one batch of 4, then each prompt alone) and
one 1,024-token prompt x 32 tokens (chunked prefill through the slots), and times batch-1
decode. Every run, reference included, runs with deterministic algorithms (the child's
`deterministic` spec key): torch.compile otherwise picks some reduction kernels by timing
them in each process, which changes their summation order, and two unpaged runs disagreed. The JSON (--out,
rewritten after every configuration) has per configuration: token identity with its
reference (and the first differing token), bit identity of the sampled tokens' logprobs,
TTFT/TPOT, vLLM's CUDA-graph mode and the pager's counters per tier. Logs go to
<out stem>_logs/ (prepare.log and one per run).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass, field, replace
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
CHILD = REPO / "scripts" / "vllm_e2e_child.py"
MAKERS = {"qwen3moe": REPO / "scripts" / "make_tiny_moe.py", "qwen4exp": REPO / "scripts" / "make_qwen4exp.py"}
SHAPES = {
    # Qwen3.6-35B-A3B's routed experts and attention sizes, few layers, FP8 as Qwen ships it, drawn on the GPU.
    "qwen3.6": dict(
        maker="qwen3moe",
        experts=256,
        top_k=8,
        hidden=2048,
        moe_intermediate=512,
        vocab=8192,
        heads=16,
        kv_heads=4,
        head_dim=128,
        dtype="fp8",
        device="cuda",
    ),
    # A small bf16 model to check this script's plumbing on vLLM's CPU build (not a GPU result).
    "smoke": dict(
        maker="qwen3moe",
        experts=32,
        top_k=4,
        hidden=256,
        moe_intermediate=128,
        vocab=2048,
        heads=4,
        kv_heads=2,
        head_dim=64,
        dtype="bf16",
        device="cpu",
    ),
    # Qwen3.8-Flash-Next (Qwen4Exp): 512 experts of 2560 -> 640, top-10 plus a shared expert, hyper-connections,
    # QSA and linear-attention layers, a PLE layer with its n-gram table, the MTP head; few layers, FP8, on the GPU.
    # 8 indexer heads: vLLM 0.33's QSA prefill-logits kernel (tiles tuned on GB300) keeps 64 query rows x every
    # indexer head x 128 dims in shared memory; with the generator's default 16 heads that is 303 KB, more than an
    # H200 has (run 1, docs/benchmarks.md). The released config's head count is not public.
    "flash-next": dict(maker="qwen4exp", experts=512, top_k=10, indexer_heads=8, dtype="fp8", device="cuda"),
    # Flash-Next's layer shapes with fewer experts, for tests/gpu: 320 experts make the 12.5% VRAM tier exactly the
    # 40 ids a captured 4-token step needs at top-10.
    "flash-next-small": dict(maker="qwen4exp", experts=320, top_k=10, indexer_heads=8, dtype="fp8", device="cuda"),
    # The same architecture small and bf16, to check this script's plumbing on vLLM's CPU build (not a GPU result).
    "flash-next-smoke": dict(
        maker="qwen4exp", experts=32, top_k=4, hidden=256, moe_intermediate=128, dtype="bf16", device="cpu"
    ),
}
QWEN4EXP_ENGINE = {
    "compilation_config": {"cudagraph_mode": "PIECEWISE"},
    "additional_config": {"gdn_prefill_backend": "triton"},
}
"""The preset's engine settings for Qwen4Exp (presets/qwen3.8-flash-next.toml): PIECEWISE breakable CUDA graphs."""
QWEN4EXP_ENV = {"VLLM_USE_BREAKABLE_CUDAGRAPH": "1"}
PROMPTS = [
    "The sea is calm and the boats are",
    "Write a short note about the river",
    "one two three four five six seven",
    "A green tree stands near the old house because",
]


@dataclass(frozen=True)
class Config:
    """One vLLM run."""

    name: str
    """Row label."""
    env: dict[str, str] = field(default_factory=dict)
    """BIGMOE_* variables of the run (none: the plugin stays off)."""
    needs_paging_file: bool = False
    """Wait for the background paging-file build first."""
    eager: bool = False
    """enforce_eager=True (no CUDA graphs)."""
    reference: str = "unpaged"
    """Name of the run whose tokens this one must reproduce (itself: it is a reference)."""
    engine: dict = field(default_factory=dict)
    """Extra vLLM engine arguments (speculative_config for MTP runs)."""

    @property
    def slug(self) -> str:
        """The name's first word: what --configs names it by, and its files' stem."""
        return self.name.split(" ")[0]


PREDICT = {"BIGMOE_PREDICT": "router"}
"""Issue 15's live next-layer predictor: layer l+1's router on layer l's hidden state proposes, the pager prefetches."""


PIECEWISE = {"compilation_config": {"cudagraph_mode": "PIECEWISE"}}


def configs(experts: int, paging_file: Path) -> list[Config]:
    vram40, vram12, ram50 = round(0.4 * experts), experts // 8, experts // 2
    ssd = {"BIGMOE_PAGER": "1", "BIGMOE_VRAM_SLOTS": str(vram12), "BIGMOE_RAM_SLOTS": str(ram50)}
    vram = {"BIGMOE_PAGER": "1", "BIGMOE_VRAM_SLOTS": str(vram40)}
    graphs = {
        "BIGMOE_CUDA_GRAPHS": "1",
        "BIGMOE_PREFILL_BUFFER": "0",
    }  # big steps in token ranges; -layerbuf: the buffer
    return [
        Config("unpaged", reference="unpaged"),
        # The engine's own reproducibility: batch-4 greedy tokens of two unpaged runs on two machines differed.
        Config("unpaged-repeat"),
        Config(f"vram40 ({vram40} slots)", {**vram, **graphs}),
        Config(f"vram12-ram50-ssd ({vram12}/{ram50}, checkpoint)", {**ssd, **graphs}),
        # Prefill over one buffer of the whole layer (BIGMOE_PREFILL_BUFFER) instead of token ranges.
        Config(
            f"vram40-layerbuf ({vram40} slots, whole-layer prefill buffer)",
            {**vram, **graphs, "BIGMOE_PREFILL_BUFFER": "1"},
        ),
        Config(
            f"vram12-ram50-ssd-layerbuf ({vram12}/{ram50}, checkpoint, whole-layer prefill buffer)",
            {**ssd, **graphs, "BIGMOE_PREFILL_BUFFER": "1"},
        ),
        # Issue 15: the live next-layer predictor prefetching on its side stream under vLLM's default graphs (FULL
        # decode graphs), over the SSD mix with reads ahead too, and under PIECEWISE graphs (layer calls between
        # pieces); the router keeps the final say, so tokens must equal the unpaged reference's.
        Config(f"vram40-predict ({vram40} slots, live prefetch)", {**vram, **graphs, **PREDICT}),
        # The same with each FULL graph's rounds on one side-stream branch, ordered by device flags.
        Config(
            f"vram40-predict-chain ({vram40} slots, live prefetch, chained rounds)",
            {**vram, **graphs, **PREDICT, "BIGMOE_PREFETCH_CHAIN": "1"},
        ),
        # And joined once a forward: each step settles its round on the device (core.round_sync).
        Config(
            f"vram40-predict-joinless ({vram40} slots, live prefetch, chained rounds joined once)",
            {**vram, **graphs, **PREDICT, "BIGMOE_PREFETCH_CHAIN": "1", "BIGMOE_PREFETCH_JOINLESS": "1"},
        ),
        # And copied by the host thread through the copy engines (core.host_copier).
        Config(
            f"vram40-predict-host ({vram40} slots, live prefetch, joinless rounds copied by the host thread)",
            {**vram, **graphs, **PREDICT, "BIGMOE_PREFETCH_JOINLESS": "1", "BIGMOE_PREFETCH_HOST_COPIER": "1"},
        ),
        # And each round two layers ahead of its step (the router of l+2 on layer l's state).
        Config(
            f"vram40-predict-host-dist2 ({vram40} slots, live prefetch two layers ahead, copied by the host thread)",
            {**vram, **graphs, **PREDICT, "BIGMOE_PREFETCH_HOST_COPIER": "1", "BIGMOE_PREFETCH_DISTANCE": "2"},
        ),
        Config(
            f"vram12-ram50-ssd-predict-ahead ({vram12}/{ram50}, checkpoint, live prefetch, SSD reads ahead)",
            {**ssd, **graphs, **PREDICT, "BIGMOE_SSD_READ_AHEAD": "1"},
        ),
        # PIECEWISE runs compare with a PIECEWISE reference: the graph mode alone can change the engine's numerics.
        Config("unpaged-piecewise", reference="unpaged-piecewise", engine=PIECEWISE),
        Config(
            f"vram40-piecewise ({vram40} slots, PIECEWISE graphs)",
            {**vram, **graphs},
            reference="unpaged-piecewise",
            engine=PIECEWISE,
        ),
        Config(
            f"vram40-predict-piecewise ({vram40} slots, live prefetch, PIECEWISE graphs)",
            {**vram, **graphs, **PREDICT},
            engine=PIECEWISE,
            reference="unpaged-piecewise",
        ),
        Config("unpaged-eager", eager=True, reference="unpaged-eager"),
        # Which half diverges: the device-driven pager without graphs, and the host-driven one.
        Config(f"vram40-eager-device ({vram40} slots)", {**vram, **graphs}, eager=True, reference="unpaged-eager"),
        Config(f"vram40-eager-host ({vram40} slots)", vram, eager=True, reference="unpaged-eager"),
        Config(
            f"vram12-ram50-ssd-codec ({vram12}/{ram50}, paging file, eager)",
            {**ssd, "BIGMOE_PAGING_FILE": str(paging_file), "BIGMOE_COMPRESS": "on"},
            needs_paging_file=True,
            eager=True,
            reference="unpaged-eager",
        ),
        Config(
            f"vram12-ram50-ssd-codec-graphs ({vram12}/{ram50}, paging file, CUDA graphs)",
            {**ssd, **graphs, "BIGMOE_PAGING_FILE": str(paging_file), "BIGMOE_COMPRESS": "on"},
            needs_paging_file=True,
        ),
    ]


def qwen4exp_configs(experts: int, top_k: int, spec_tokens: list[int]) -> list[Config]:
    """Issue 14's matrix: three tier mixes, each with the n-gram pager off and on, issue 15's live predictor (with SSD
    read-ahead over the SSD mix), and MTP runs, in the plan's graph mode (PIECEWISE breakable graphs). References: the
    unpaged model (n-gram table loaded by vLLM), and the unpaged model with the same MTP setting for each MTP run."""
    vram40, vram12, ram50 = round(0.4 * experts), experts // 8, experts // 2
    mixes = {
        "vramall": {"BIGMOE_PAGER": "1"},
        "vram40": {"BIGMOE_PAGER": "1", "BIGMOE_VRAM_SLOTS": str(vram40)},
        "vram12-ram50-ssd": {"BIGMOE_PAGER": "1", "BIGMOE_VRAM_SLOTS": str(vram12), "BIGMOE_RAM_SLOTS": str(ram50)},
    }
    base = {**QWEN4EXP_ENV, "BIGMOE_CUDA_GRAPHS": "1", "BIGMOE_PREFILL_BUFFER": "1"}
    out = [
        Config("unpaged", dict(QWEN4EXP_ENV), reference="unpaged", engine=QWEN4EXP_ENGINE),
        Config("unpaged-repeat", dict(QWEN4EXP_ENV), engine=QWEN4EXP_ENGINE),
    ]
    for name, env in mixes.items():
        for ngram in (False, True):
            label = f"{name}{'-ngram' if ngram else ''}"
            out.append(
                Config(label, {**base, **env, **({"BIGMOE_NGRAM": "1"} if ngram else {})}, engine=QWEN4EXP_ENGINE)
            )
    # Issue 15: the live next-layer predictor prefetching (and, over the SSD tier, reading ahead) under the same graphs.
    predict = {"BIGMOE_PREDICT": "router", "BIGMOE_NGRAM": "1"}
    out.append(Config("vram40-ngram-predict", {**base, **mixes["vram40"], **predict}, engine=QWEN4EXP_ENGINE))
    out.append(
        Config(
            "vram12-ram50-ssd-ngram-predict-ahead",
            {**base, **mixes["vram12-ram50-ssd"], **predict, "BIGMOE_SSD_READ_AHEAD": "1"},
            engine=QWEN4EXP_ENGINE,
        )
    )
    for n in spec_tokens:
        mtp = {**QWEN4EXP_ENGINE, "speculative_config": {"method": "mtp", "num_speculative_tokens": n}}
        out.append(Config(f"unpaged-mtp{n}", dict(QWEN4EXP_ENV), reference=f"unpaged-mtp{n}", engine=mtp))
        # vram40: every expert a RAM hit at worst, so the run is as fast as the reference; the SSD mix makes each
        # verification step wait for the disk (about 5 of each token's 10 experts per layer on random routing).
        for mix in ("vram40", "vram12-ram50-ssd"):
            out.append(
                Config(
                    f"{mix}-ngram-mtp{n}",
                    {**base, **mixes[mix], "BIGMOE_NGRAM": "1"},
                    reference=f"unpaged-mtp{n}",
                    engine=mtp,
                )
            )
    return out


GRAPH_CAPTURE = 4  # --max-cudagraph-capture-size of graph runs: 4 tokens x top-8 = 32 ids, the smallest slot count here


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    deadline = time.monotonic() + args.budget_s
    out = args.out.resolve()
    logs = (args.logs or out.with_name(out.stem + "_logs")).resolve()
    logs.mkdir(parents=True, exist_ok=True)
    (logs / "prepare.log").unlink(missing_ok=True)
    work = args.workdir.resolve()
    work.mkdir(parents=True, exist_ok=True)
    report: dict = {
        "mode": f"CUDA graphs (vLLM's default mode unless a configuration sets PIECEWISE: each row's cudagraph_mode; "
        f"--max-cudagraph-capture-size {GRAPH_CAPTURE}), except the configurations named eager (enforce_eager); "
        + (
            "vLLM's default compile settings"
            if args.no_deterministic
            else "deterministic engine (deterministic algorithms, Inductor without timed kernel choices)"
        ),
        "command": " ".join([Path(sys.argv[0]).name, *sys.argv[1:]]),
        "configs": [],
        "passed": False,
    }
    started = time.monotonic()
    shape = SHAPES[args.shape]
    name = f"{args.shape}-{shape['dtype']}-{args.layers}l"
    paging_file = work / f"{name}.bmpf"
    matrix = (
        qwen4exp_configs(shape["experts"], shape["top_k"], args.spec_tokens)
        if shape["maker"] == "qwen4exp"
        else configs(shape["experts"], paging_file)
    )
    unknown = sorted(set(args.configs or []) - {c.slug for c in matrix})
    if unknown:
        print(
            f"gpu_vllm_e2e: no configuration named {', '.join(unknown)} for the {args.shape} shape; "
            f"choose from {', '.join(c.slug for c in matrix)}",
            file=sys.stderr,
        )
        return 2
    try:
        model, has_tokenizer, made_s = make_checkpoint(work / name, shape, args.layers, logs)
    except CheckpointFailed as e:
        report["error"] = str(e)
        write_json(out, report)
        print(f"gpu_vllm_e2e: {e}", file=sys.stderr)
        return 1
    report["checkpoint"] = {
        "path": str(model),
        "shape": args.shape,
        "layers": args.layers,
        **shape,
        "tokenizer": has_tokenizer,
        "seconds": made_s,
    }
    # The codec configurations read a compressed paging file; Qwen4Exp's matrix has none.
    builder = start_paging_build(model, paging_file, logs) if shape["maker"] == "qwen3moe" else None
    try:
        todo = [with_settings(c, args.setting) for c in chosen(matrix, args.configs)]
        run_all(
            todo,
            make_spec(model, has_tokenizer, shape, args),
            builder,
            paging_file,
            work,
            logs,
            deadline,
            report,
            out,
            started,
            args.parallel,
        )
    finally:
        if builder is not None and builder.poll() is None:
            builder.kill()
    paged = [r for r in report["configs"] if not r.get("reference")]
    report["passed"] = all(r.get("result") is not None for r in report["configs"]) and all(
        r.get("tokens_identical") and r.get("serial_tokens_identical") and r.get("long_tokens_identical") for r in paged
    )
    write_json(out, report)
    print_table(report)
    return 0 if report["passed"] else 1


def run_all(
    todo: list[Config],
    spec: dict,
    builder,
    paging_file: Path,
    work: Path,
    logs: Path,
    deadline: float,
    report: dict,
    out: Path,
    started: float,
    parallel: int = 1,
) -> None:
    """Every configuration, `parallel` at a time (each its own process and share of GPU memory), then each compared
    with its reference; the report is rewritten as runs finish."""
    from concurrent.futures import ThreadPoolExecutor

    names = {c.name for c in todo}
    rows: dict[str, dict] = {}

    def one(config: Config) -> None:
        if config.needs_paging_file and "paging_file" not in report:
            report["paging_file"] = finish_paging_build(builder, paging_file, deadline)
        if time.monotonic() >= deadline:
            row = skipped(config, "time budget spent")
        elif config.reference not in names:
            row = skipped(config, f"its reference {config.reference} is not among the configurations run")
        elif config.needs_paging_file and "error" in report["paging_file"]:
            row = skipped(config, "no paging file: " + report["paging_file"]["error"])
        else:
            run_spec = {
                **spec,
                "enforce_eager": config.eager,
                "engine": config.engine,
                "max_cudagraph_capture_size": None if config.eager else GRAPH_CAPTURE,
            }
            row = run_config(config, run_spec, work, logs, deadline)
        rows[config.name] = row
        report["configs"] = [rows[c.name] for c in todo if c.name in rows]
        report["total_s"] = round(time.monotonic() - started, 1)
        write_json(out, report)

    with ThreadPoolExecutor(max_workers=max(1, parallel)) as pool:
        list(pool.map(one, todo))
    references = {c.name: rows[c.name].get("result") for c in todo if c.reference == c.name}
    for config in todo:
        row = rows[config.name]
        if config.reference == config.name:
            row["reference"] = True
        elif references.get(config.reference) is None and "error" not in row:
            row["error"] = f"no comparison: the reference run {config.reference} failed (see its log)"
        compare(row, references.get(config.reference))
    report["configs"] = [rows[c.name] for c in todo]
    report["total_s"] = round(time.monotonic() - started, 1)
    write_json(out, report)


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", type=Path, required=True, help="result JSON (rewritten after every configuration)")
    p.add_argument(
        "--workdir",
        type=Path,
        default=Path("/tmp/bigmoe-vllm-e2e"),
        help="checkpoint and paging file (a local disk where O_DIRECT works)",
    )
    p.add_argument(
        "--shape",
        choices=tuple(SHAPES),
        default="qwen3.6",
        help="qwen3.6: the GPU run; smoke: a small bf16 model for vLLM's CPU build (checks the script only)",
    )
    p.add_argument("--layers", type=int, default=2, help="decoder layers (qwen3.6: 256 experts, 0.77 GiB of FP8 each)")
    p.add_argument("--tokens", type=int, default=128, help="tokens generated for each of the 4 prompts")
    p.add_argument("--long-prompt", type=int, default=1024, help="tokens of the long prompt")
    p.add_argument("--long-tokens", type=int, default=32, help="tokens generated after the long prompt")
    p.add_argument("--timing-tokens", type=int, default=65, help="tokens of the batch-1 timing request (TTFT, TPOT)")
    p.add_argument("--gpu-memory-utilization", type=float, default=0.15)
    p.add_argument(
        "--parallel",
        type=int,
        default=1,
        help="configurations run at once (each in its own process with its share of GPU memory)",
    )
    p.add_argument(
        "--spec-tokens",
        type=lambda v: [int(x) for x in v.split(",") if x],
        default=[1, 3],
        help="Qwen4Exp shapes: MTP speculative-token counts to run (comma list; empty: none)",
    )
    p.add_argument(
        "--configs",
        type=lambda v: v.split(","),
        default=None,
        help="comma list of configurations to run (first word of their names); default all",
    )
    p.add_argument(
        "--logs",
        type=Path,
        default=None,
        help="directory of the per-run logs (default: <out stem>_logs beside --out; the device tool returns 8 files)",
    )
    p.add_argument(
        "--no-deterministic",
        action="store_true",
        help="vLLM's defaults (shows that the engine alone then does not reproduce its greedy tokens)",
    )
    p.add_argument(
        "--setting",
        type=setting,
        action="append",
        default=[],
        metavar="BIGMOE_NAME=VALUE",
        help="a pager setting added to every paged configuration (repeatable); the engines otherwise get no BIGMOE_* "
        "variable of this environment",
    )
    p.add_argument(
        "--budget-s",
        type=float,
        default=540.0,
        help="stop starting runs (and cut a running one) after this many seconds",
    )
    return p.parse_args(argv)


# ---- the checkpoint and the paging file -------------------------------------------------------


class CheckpointFailed(RuntimeError):
    """The generator could not write the checkpoint; the message is one line."""


def make_checkpoint(out: Path, shape: dict, layers: int, logs: Path) -> tuple[Path, bool, float]:
    """The project's generator; where the tokenizers package is missing, a checkpoint without a tokenizer."""
    base = [sys.executable, str(MAKERS[shape["maker"]]), str(out), "--layers", str(layers), "--seed", "0"]
    for key, value in shape.items():
        if key == "maker":
            continue
        base += [f"--{key.replace('_', '-')}", str(value)]
    started = time.monotonic()
    for extra in ([], ["--no-tokenizer"]):
        proc = subprocess.run(base + extra, env=child_env({}), capture_output=True, text=True)
        with open(
            logs / "prepare.log", "a"
        ) as log:  # one file for both preparation steps: $OUT returns 8 files at most
            log.write(proc.stdout + proc.stderr)
        if proc.returncode == 0:
            return out, not extra, round(time.monotonic() - started, 1)
        if "tokenizers" not in proc.stderr:
            break
    last = (proc.stderr.strip().splitlines() or ["(no output)"])[-1]
    raise CheckpointFailed(f"making the checkpoint failed (see prepare.log): {last}")


def start_paging_build(model: Path, out: Path, logs: Path) -> subprocess.Popen:
    """build_paging_file(compress=True) in a background process (the codec encodes on the CPU)."""
    code = (
        "import sys, time; from pathlib import Path; from bigmoe_pager.core.paging_build import build_paging_file; "
        "t = time.monotonic(); build_paging_file(Path(sys.argv[1]), Path(sys.argv[2]), compress=True); "
        "print('built in', round(time.monotonic() - t, 1), 's')"
    )
    log = open(logs / "prepare.log", "a")
    return subprocess.Popen(
        [sys.executable, "-c", code, str(model), str(out)], env=child_env({}), stdout=log, stderr=subprocess.STDOUT
    )


def finish_paging_build(builder: subprocess.Popen, path: Path, deadline: float) -> dict:
    try:
        rc = builder.wait(timeout=max(deadline - time.monotonic(), 1))
    except subprocess.TimeoutExpired:
        builder.kill()
        return {"path": str(path), "error": "not built within the time budget"}
    if rc != 0:
        return {"path": str(path), "error": f"build failed (exit {rc}); see prepare.log"}
    return {"path": str(path), "bytes": path.stat().st_size, "compressed": True}


# ---- runs ---------------------------------------------------------------------------------------


def make_spec(model: Path, has_tokenizer: bool, shape: dict, args) -> dict:
    long_ids = long_prompt_ids(model, has_tokenizer, args.long_prompt, shape.get("vocab", 8192))
    return {
        "model": str(model),
        "max_model_len": 2048,
        "gpu_memory_utilization": args.gpu_memory_utilization,
        "deterministic": not args.no_deterministic,
        # A fixed KV cache where there is no GPU to size from (vLLM's CPU build), or where several engines share one
        # GPU (--parallel): vLLM's profile would count the others' allocations as its own.
        "kv_cache_memory_bytes": 256 << 20 if shape["device"] != "cuda" else (2 << 30 if args.parallel > 1 else None),
        "skip_tokenizer_init": not has_tokenizer,
        "prompts": PROMPTS if has_tokenizer else [long_ids[i * 37 : i * 37 + 9] for i in range(len(PROMPTS))],
        "max_tokens": args.tokens,
        "long_ids": long_ids,
        "long_max_tokens": args.long_tokens,
        "timing_ids": long_ids[:16],
        "warmup_ids": long_ids[16:32],
        "timing_tokens": args.timing_tokens,
    }


def long_prompt_ids(model: Path, has_tokenizer: bool, n: int, vocab: int) -> list[int]:
    """n token ids: the prompts' text repeated and tokenized, or seeded ids below the special tokens."""
    if has_tokenizer:
        from tokenizers import Tokenizer

        tok = Tokenizer.from_file(str(model / "tokenizer.json"))
        text = " ".join(PROMPTS)
        ids: list[int] = []
        while len(ids) < n:
            text = text + " " + text
            ids = tok.encode(text).ids
        return ids[:n]
    return np.random.default_rng(0).integers(0, min(vocab, 8192) - 3, n).tolist()  # below the 3 special tokens


def run_config(config: Config, spec: dict, work: Path, logs: Path, deadline: float) -> dict:
    slug = config.slug
    spec_path, result_path = work / f"{slug}.spec.json", work / f"{slug}.result.json"
    spec_path.write_text(json.dumps(spec))
    result_path.unlink(missing_ok=True)
    row: dict = {"name": config.name, "env": config.env}
    started = time.monotonic()
    with open(logs / f"{slug}.log", "w") as log:
        try:
            proc = subprocess.run(
                [sys.executable, str(CHILD), str(spec_path), str(result_path)],
                env=child_env(config.env),
                stdout=log,
                stderr=subprocess.STDOUT,
                timeout=max(deadline - time.monotonic(), 1),
            )
            rc = proc.returncode
        except subprocess.TimeoutExpired:
            rc = None
    row["seconds"] = round(time.monotonic() - started, 1)
    if rc is None:  # its log's last line is whatever the engine printed last, often a harmless warning
        row["error"] = f"stopped at the call's budget after {row['seconds']} s: raise --budget-s or run fewer engines"
        return row
    if rc != 0 or not result_path.exists():
        row["error"] = f"exit {rc}: " + last_error_line(logs / f"{slug}.log")
        return row
    row["result"] = json.loads(result_path.read_text())
    return row


def skipped(config: Config, why: str) -> dict:
    return {"name": config.name, "env": config.env, "error": "not run: " + why}


def setting(text: str) -> tuple[str, str]:
    """--setting's value: ('BIGMOE_PREFETCH_CHAINED_ONLY', '1') for 'BIGMOE_PREFETCH_CHAINED_ONLY=1', checked by the
    plugin's own parser (argparse turns the error into one line and exit 2)."""
    from bigmoe_pager.settings import PagerSettings, SettingsError, variable_names

    name, eq, value = text.partition("=")
    if not (eq and name in variable_names() and name != "BIGMOE_SETTINGS"):  # a file would hide what the row ran
        raise argparse.ArgumentTypeError(f"{text!r}: expected BIGMOE_NAME=VALUE, a variable of bigmoe_pager.settings")
    try:
        PagerSettings.from_env({name: value})
    except SettingsError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return name, value


def chosen(matrix: list[Config], names: list[str] | None) -> list[Config]:
    """The configurations named (by the first word of their names; None: all) and the references they are compared
    with, in the matrix's order: a paged run is never left without its reference because the list forgot it."""
    if not names:
        return list(matrix)
    picked = {c.name for c in matrix if c.slug in names}
    picked |= {c.reference for c in matrix if c.name in picked}
    return [c for c in matrix if c.name in picked]


def with_settings(config: Config, settings: list[tuple[str, str]]) -> Config:
    """`config` with --setting's variables added where the pager is on (the row's env records them)."""
    if not settings or config.env.get("BIGMOE_PAGER") != "1":
        return config
    return replace(config, env={**config.env, **dict(settings)})


def child_env(extra: dict[str, str]) -> dict[str, str]:
    """This environment without BIGMOE_*, plus extra; the checkout's pager/app/bench first on the path."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("BIGMOE_")}
    path = [str(REPO / d) for d in ("pager", "app", "bench")] + [p for p in env.get("PYTHONPATH", "").split(":") if p]
    env.update(
        PYTHONPATH=":".join(path),
        PYTHONUNBUFFERED="1",
        VLLM_ENABLE_V1_MULTIPROCESSING="0",
        HF_HUB_OFFLINE="1",
        TRANSFORMERS_OFFLINE="1",
        VLLM_NO_USAGE_STATS="1",
    )
    env.setdefault("VLLM_USE_FLASHINFER_SAMPLER", "0")
    env.setdefault("VLLM_DEEP_GEMM_WARMUP", "skip")  # its ~3-minute warm-up changes no result
    env.update(extra)
    return env


def last_error_line(log: Path) -> str:
    lines = [l for l in log.read_text(errors="replace").splitlines() if l.strip()]
    errors = [l for l in lines if "Error" in l or "error:" in l]
    return (errors or lines or ["(no output)"])[-1][-400:]


# ---- comparison and output ---------------------------------------------------------------------


ENGINE_FACTS = (
    "prefetch_joins",
    "prefetch_forks",
    "prefetch_chain_timeouts",
    "prefetch_chain_cancels",
    "prefetch_chain_late",
    "prefetch_host_copier",
    "step_kernels",
    "load_copy_bytes",
    "load_copy_s",
)
"""What an engine's run reports beside its counters (adapters.vllm.process.engine_facts), copied into its row."""


def compare(row: dict, reference: dict | None) -> None:
    """Token and logprob identity of a run with the reference, and its pager hit rates."""
    result = row.get("result")
    if result is None:
        return
    row["ttft_ms"], row["tpot_ms"] = result["ttft_ms"], result["tpot_ms"]
    row["cudagraph_mode"] = result.get("cudagraph_mode")
    for fact in ENGINE_FACTS:  # absent: pager off
        if fact in result:
            row[fact] = result[fact]
    row["pager"] = {
        tier: {**c, "hit_rate": round(c["hits"] / c["lookups"], 4) if c["lookups"] else None}
        for tier, c in result["pager"].items()
    }
    if reference is None or row.get("reference"):
        return
    for part, key in (("short", "tokens"), ("serial", "serial_tokens"), ("long", "long_tokens")):
        if part not in result or part not in reference:
            continue
        mine, ref = result[part], reference[part]
        firsts = [first_difference(a, b) for a, b in zip(mine["tokens"], ref["tokens"])]
        row[f"{key}_identical"] = len(mine["tokens"]) == len(ref["tokens"]) and all(f is None for f in firsts)
        row[f"{key.replace('tokens', 'first_divergence')}"] = firsts
        row[f"{key.replace('tokens', 'logprobs')}_identical"] = (
            None if None in mine["logprobs"] + ref["logprobs"] else mine["logprobs"] == ref["logprobs"]
        )


def first_difference(a: list[int], b: list[int]) -> int | None:
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def write_json(path: Path, report: dict) -> None:
    """The report without the per-token logprobs (their identity is recorded), written whole or not at all."""
    slim = {
        **report,
        "configs": [
            {
                **r,
                "result": {
                    k: ({**v, "logprobs": "compared"} if k in ("short", "serial", "long") else v)
                    for k, v in r["result"].items()
                },
            }
            if "result" in r
            else r
            for r in report["configs"]
        ],
    }
    tmp = path.with_suffix(".partial")
    tmp.write_text(json.dumps(slim, indent=1))
    tmp.replace(path)


def print_table(report: dict) -> None:
    print(f"mode: {report['mode']}")
    print(
        f"{'configuration':48s} {'tokens':>7s} {'alone':>6s} {'long':>6s} {'logprobs':>9s} "
        f"{'TTFT ms':>8s} {'TPOT ms':>8s}"
        f" {'VRAM hit':>8s} {'RAM hit':>8s} {'SSD GB':>7s} {'s':>6s}"
    )
    for r in report["configs"]:
        if "error" in r:
            print(f"{r['name']:48s} ERROR {r['error']}")
            continue
        pager = r.get("pager") or {}
        rate = lambda tier: "-" if (pager.get(tier) or {}).get("hit_rate") is None else f"{pager[tier]['hit_rate']:.3f}"  # noqa: E731
        ssd_gb = f"{pager['ssd']['bytes_moved'] / 1e9:.1f}" if "ssd" in pager else "-"
        if r.get("reference"):
            tokens = alone = long = logprobs = "ref"
        else:
            tokens, long = same(r.get("tokens_identical")), same(r.get("long_tokens_identical"))
            alone = same(r.get("serial_tokens_identical"))
            both = [r.get("logprobs_identical"), r.get("serial_logprobs_identical"), r.get("long_logprobs_identical")]
            logprobs = same(None if None in both else all(both))
        ms = lambda v: "-" if v is None else f"{v:.2f}"  # noqa: E731
        print(
            f"{r['name']:48s} {tokens:>7s} {alone:>6s} {long:>6s} {logprobs:>9s} "
            f"{ms(r['ttft_ms']):>8s} {ms(r['tpot_ms']):>8s}"
            f" {rate('vram'):>8s} {rate('ram'):>8s} {ssd_gb:>7s} {r['seconds']:6.1f}"
        )
    print(f"total {report.get('total_s')} s; passed: {report.get('passed')}")


def same(value: bool | None) -> str:
    return "-" if value is None else ("same" if value else "DIFF")


if __name__ == "__main__":
    sys.exit(main())
