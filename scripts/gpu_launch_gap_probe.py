"""Does a kernel running beside a CUDA graph's chain slow the chain's launches, and which of its habits? (run 20)

Run 20's kernel timelines (docs/benchmarks.md) found vLLM's back-to-back kernels 0.10 us apart with no prefetch
and 0.42 us apart while a prefetch placement's kernel ran beside them, about 0.3 ms a token over some 1,000
kernels; yet run 18 measured one program that only polled for the forward's steps at 0.05 ms a token. This probe
tells the possible causes apart without vLLM and without the profiler: one captured chain of N tiny kernels on the
main stream, and beside it, in the same graph,

    linear      nothing (no side branch)
    fork        a side branch of one tiny kernel, forked at the start and joined at the end (the topology alone)
    sleep       a side kernel that sleeps on the SM clock for half the chain (resident, no memory traffic)
    spin        a side kernel that polls a device word until the chain's middle kernel bumps it, as the pager's
                waits do (GPU-scope acquire loads, 256 ns naps between polls: core.memory_order)
    spin-hard   the same with plain volatile loads and no nap
    spin-sys    spin, each poll also reading a pinned host word at system scope (as the SSD mailbox's waits do)
    store-sys   spin, each poll also storing to a pinned host word at system scope (as a round's publication does)
    atomics     spin, each poll also adding to a device word atomically (as the rounds' claims do)
    outside-sleep, outside-spin
                sleep and spin launched on another stream just before each replay, outside the graph: if these
                cost nothing where sleep and spin cost, the graph's shape is what costs, and a decider that lives
                outside vLLM's graphs would be free of it (the host runs ahead of the replays, so these side
                kernels queue on their stream: outside-spin is resident through most of the timed replays)
    solo-sleep  (--fresh only) a sleeping kernel alone on the main stream, nothing beside it, before linear's replays
    eager-beside
                (--fresh only) the sleep on a side stream beside an eager (uncaptured) chain, before linear's replays

The first H200 run (session 26) found linear itself 21% slower once any variant with a long side kernel had run
in the process: the state persists. --fresh runs each variant in a process of its own, timing linear before and
after it (and again after two seconds idle), with the SM clock, so what a variant leaves behind is seen apart
from what it costs while it runs.

Each variant's graph is replayed REPLAYS times; the result is microseconds per chain kernel, and against linear.
Every side kernel ends before the chain does, so a slower replay is a slower chain.

    python3 scripts/gpu_launch_gap_probe.py --kernels 1000 --out /tmp/gap.json
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "pager"))
try:
    import triton
    import triton.language as tl
except ImportError:
    triton = tl = None

VARIANTS = (
    "linear",
    "fork",
    "sleep",
    "spin",
    "spin-hard",
    "spin-sys",
    "store-sys",
    "atomics",
    "outside-sleep",
    "outside-spin",
)
PRIMERS = ("solo-sleep", "eager-beside")
"""--fresh only: something done once before linear's replays, not a graph of its own."""
POLL_MODES = {"spin": 0, "spin-hard": 1, "spin-sys": 2, "store-sys": 3, "atomics": 4, "outside-spin": 0}
"""The side kernel's MODE for each polling variant (_side_kernel)."""
IN_GRAPH_SIDE = ("fork", "sleep", "spin", "spin-hard", "spin-sys", "store-sys", "atomics")
SLEEP_CYCLES_PER_US = 1980  # H200 SM clock, about 1.98 GHz
MAX_SPINS = 1 << 24  # polls: a second or more, so a missed bump slows one replay rather than hanging the probe

if triton is not None:
    from bigmoe_pager.core.memory_order import GPU_SCOPE, SYS_SCOPE, load_acquire, pause, store_release

    # one compiled kernel for every target and spin bound: the warm-up before a capture must be the kernel the
    # capture launches, and the outside variants' targets (1, 2, ... 16 ...) must not compile mid-timing
    @triton.jit(do_not_specialize=["target", "max_spins"])
    def _side_kernel(flag_ptr, host_ptr, word_ptr, target, max_spins, MODE: tl.constexpr, ON_GPU: tl.constexpr):
        """Poll flag_ptr until it reaches `target` (-1: one more than it holds at the start), doing MODE's extra
        memory operation each time; gives up after max_spins polls."""
        seen = tl.load(flag_ptr, volatile=True)
        goal = seen + 1  # captured: wait for the next bump of whatever the word holds now
        if target >= 0:
            goal = seen * 0 + target  # int64, as the word
        spins = 0
        kept = seen * 0
        while (seen < goal) & (spins < max_spins):
            if MODE == 1:
                seen = tl.load(flag_ptr, volatile=True)
            else:
                pause(ON_GPU)
                if MODE == 2:
                    kept += load_acquire(host_ptr, SYS_SCOPE, ON_GPU)
                if MODE == 3:
                    store_release(host_ptr, spins.to(tl.int64), SYS_SCOPE, ON_GPU)
                if MODE == 4:
                    tl.atomic_add(word_ptr, 1)
                seen = load_acquire(flag_ptr, GPU_SCOPE, ON_GPU)
            spins += 1
        tl.store(word_ptr + 1, kept)  # keeps the system-scope reads


def chain_step(chain: str, width: int):
    """One kernel of the main chain: an add over `width` floats, or a decode-shaped GEMM ([width, 4096] x [4096,
    4096] bf16, whose CTAs fill an SM's registers and shared memory, as vLLM's do)."""
    if chain == "add":
        x = torch.zeros(width, device="cuda")
        return lambda: x.add_(1.0)
    a = torch.randn(width, 4096, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16)
    c = torch.empty(width, 4096, device="cuda", dtype=torch.bfloat16)
    return lambda: torch.mm(a, b, out=c)


def chain_us(variant: str, kernels: int, replays: int, sleep_us: float, chain: str = "add", width: int = 1) -> float:
    """Microseconds per replay of one captured graph: the chain and, beside it, the variant's side branch."""
    x = torch.zeros(1, device="cuda")
    step = chain_step(chain, width)
    step()
    flag = torch.zeros(1, dtype=torch.int64, device="cuda")
    word = torch.zeros(2, dtype=torch.int64, device="cuda")
    host = torch.zeros(1, dtype=torch.int64, pin_memory=True)
    side = torch.cuda.Stream()

    def side_kernel(target: int) -> None:
        _side_kernel[(1,)](flag, host, word, target, MAX_SPINS, MODE=POLL_MODES[variant], ON_GPU=True)

    if variant in POLL_MODES:  # compiled before the capture: a module load inside one is not allowed
        _side_kernel[(1,)](flag, host, word, 0, 1, MODE=POLL_MODES[variant], ON_GPU=True)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        main = torch.cuda.current_stream()
        step()
        if variant in IN_GRAPH_SIDE:
            side.wait_stream(main)
            with torch.cuda.stream(side):
                if variant == "fork":
                    x.mul_(1.0)
                elif variant == "sleep":
                    torch.cuda._sleep(int(sleep_us * SLEEP_CYCLES_PER_US))
                else:
                    side_kernel(-1)
        for i in range(kernels - 1):
            step()
            if i == kernels // 2:
                flag.add_(1)
        if variant in IN_GRAPH_SIDE:
            main.wait_stream(side)
    torch.cuda.synchronize()
    bumps = int(flag.item())

    def replay() -> None:
        nonlocal bumps
        if variant == "outside-sleep":
            with torch.cuda.stream(side):
                torch.cuda._sleep(int(sleep_us * SLEEP_CYCLES_PER_US))
        elif variant == "outside-spin":
            with torch.cuda.stream(side):
                side_kernel(bumps + 1)
        graph.replay()
        bumps += 1

    for _ in range(5):
        replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(replays):
        replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1000.0 / replays


def prime(variant: str, kernels: int, sleep_us: float) -> None:
    """Run a PRIMERS entry once, outside any graph, and wait for it."""
    x = torch.zeros(1, device="cuda")
    cycles = int(sleep_us * SLEEP_CYCLES_PER_US)
    if variant == "solo-sleep":
        torch.cuda._sleep(cycles)
    else:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            torch.cuda._sleep(cycles)
        for _ in range(kernels):
            x.add_(1.0)
        torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()


def sm_clock_mhz() -> int | None:
    try:
        return int(torch.cuda.clock_rate())
    except Exception:  # pynvml absent or not permitted: the clock is optional context
        return None


def one_process(variant: str, kernels: int, replays: int) -> dict:
    """--one: linear three times, the variant three times (or its primer once and linear three times), linear three
    times again, and once more after two seconds idle; replay microseconds each, with the SM clock after each."""

    def timed(v: str, sleep_us: float) -> list[tuple[float, int | None]]:
        return [(round(chain_us(v, kernels, replays, sleep_us), 2), sm_clock_mhz()) for _ in range(3)]

    before = timed("linear", 0.0)
    sleep_us = min(t for t, _ in before) / 2
    if variant in PRIMERS:
        prime(variant, kernels, sleep_us)
        during = timed("linear", 0.0)
    else:
        during = timed(variant, sleep_us)
    after = timed("linear", 0.0)
    time.sleep(2.0)
    rested = timed("linear", 0.0)
    return {"before": before, "variant": during, "after": after, "rested": rested}


def fresh(args: argparse.Namespace) -> dict:
    rows = {}
    for variant in ("linear", "fork", *PRIMERS, *VARIANTS[2:]):
        done = subprocess.run(
            [
                sys.executable,
                __file__,
                "--one",
                variant,
                "--kernels",
                str(args.kernels),
                "--replays",
                str(args.replays),
                "--out",
                "-",
            ],
            capture_output=True,
            text=True,
            timeout=300,
        )
        if done.returncode != 0:
            rows[variant] = {"error": done.stderr.strip().splitlines()[-1:] or [f"exit {done.returncode}"]}
        else:
            rows[variant] = json.loads(done.stdout)
        r = rows[variant]
        if "error" in r:
            print(f"{variant:13s} {r['error']}")
        else:
            line = "  ".join(
                f"{k} {min(t for t, _ in r[k]):8.2f}@{r[k][-1][1]}" for k in ("before", "variant", "after", "rested")
            )
            print(f"{variant:13s} {line}", flush=True)
    return {
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "kernels": args.kernels,
        "replays": args.replays,
        "fresh": rows,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kernels", type=int, default=1000, help="tiny kernels in the main chain")
    parser.add_argument("--replays", type=int, default=50)
    parser.add_argument("--chain", choices=("add", "mm"), default="add", help="the main chain's kernel (chain_step)")
    parser.add_argument("--width", type=int, default=1, help="floats an add covers, or the GEMM's rows")
    parser.add_argument("--rounds", type=int, default=3, help="every variant this many times, interleaved")
    parser.add_argument("--out", required=True, help="a JSON file ('-' with --one: stdout)")
    parser.add_argument("--fresh", action="store_true", help="each variant in a process of its own (see above)")
    parser.add_argument("--one", choices=("linear", "fork", *PRIMERS, *VARIANTS[2:]), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if not torch.cuda.is_available() or triton is None:
        print("gpu_launch_gap_probe: needs a CUDA GPU and Triton", file=sys.stderr)
        return 2
    if args.one:
        print(json.dumps(one_process(args.one, args.kernels, args.replays)))
        return 0
    if args.fresh:
        with open(args.out, "w") as f:
            json.dump(fresh(args), f, indent=1)
        return 0
    for _ in range(4):  # the process's first three graphs replayed 18% faster than every later one (run 21)
        linear = chain_us("linear", args.kernels, args.replays, 0.0, args.chain, args.width)
    sleep_us = linear / 2
    rows: dict[str, list[float]] = {v: [] for v in VARIANTS}
    for _ in range(args.rounds):
        for variant in VARIANTS:
            rows[variant].append(chain_us(variant, args.kernels, args.replays, sleep_us, args.chain, args.width))
    base = min(rows["linear"])
    result = {
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "kernels": args.kernels,
        "chain": args.chain,
        "width": args.width,
        "replays": args.replays,
        "sleep_us": sleep_us,
        "variants": {
            v: {
                "replay_us": [round(t, 2) for t in ts],
                "us_per_kernel": round(min(ts) / args.kernels, 4),
                "extra_us_per_kernel": round((min(ts) - base) / args.kernels, 4),
            }
            for v, ts in rows.items()
        },
    }
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    for v, r in result["variants"].items():
        print(f"{v:8s} {r['us_per_kernel']:.4f} us a kernel ({r['extra_us_per_kernel']:+.4f}) {r['replay_us']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
