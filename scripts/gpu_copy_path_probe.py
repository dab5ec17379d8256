"""What one expert copy costs on each path a step could take it by, and what copy-engine traffic costs the kernels
beside it: issue 15's demand misses and prefetch copies taken apart on the GPU (the pager's real parts, no vLLM).

Run 28 (docs/benchmarks.md) measured larger prefetch rounds on the copy engines costing about what their copies
take, not hidden behind compute, and sim_window.py's timeline puts most of what is left at 102 slots on the steps'
own misses (72 us each on the SMs against 57 us at the copy engines' 55 GB/s). Which of those is the link, which the
host thread's round trip and which the kernels slowed beside a copy, this tells apart:

    sm-N      N experts copied by the pager's copy kernel on the SMs, one program per 8 KiB block (its fastest copy)
    step-N    the same with the fused step's programs (PROGRAMS_PER_SM per SM) striding over the N experts' blocks,
              as a decode step copies its misses
    host-N    one kernel publishes N entries to the host copier's mailbox (core.host_copier, the thread serving it
              hot) and waits on the device until their completion words land: what a step would wait if it handed
              its misses to the copy engines (the round trip included)
    hostwt-N  host-N with the copier serving the two weight components only, as it would if every scale block
              stayed in VRAM (their two small copies an expert left out): what those copies cost the copier
    stepflat-N  step-N into packed slots (below): one component an expert, the whole record's bytes
    hostflat-N  host-N into packed slots: each slot one run of bytes holding the four components at their record
              offsets, so the copier copies an expert as one piece (the component tensors would be strided views)
    dma-N     the N experts' components copied by cudaMemcpyAsync nodes, one per component (the copier's calls
              without its thread): the copy engines' floor for the same bytes
    goal-N    dma-N with an 8-byte copy of each expert's completion word after its components, as the copier
              writes `copied[slot]` (what one more small DMA an expert costs)
    flat-N    the same bytes as one contiguous copy: what the per-component copies cost over it
    pair-N    flat-N split in two, the halves copied at once on two streams: do two copy engines together move more
              than one (run 29: one moves an expert at 37-40 GB/s, the link is rated 55)?
    mixed-N   half the experts by the copy kernel on the SMs, the other half at once by a copy engine on a second
              stream, as a step's misses beside a prefetch round: the link's rate when both kinds share it
    dense     a chain of small bf16 kernels (40 layers x --dense, vLLM's decode stand-in), no copy
Suffix -busy: the same while another stream keeps the copy engines busy with host-to-device copies of 64 MiB (a
prefetch backlog); -smbusy: while another stream keeps SM programs copying records from pinned memory into scratch
slots (the steps' own misses, as beside a prefetch). Either starts just before the timed replays and outlasts them.

Each variant is one CUDA graph holding --repeat copies of its work (the N experts go into the same N slots each
time; host-N publishes a new round each time and waits for it), replayed --replays times between two events; the
figure is microseconds per repeat. --eager launches the same calls one by one instead (is a slow row the
graph's?). After the timed replays every slot's bytes are checked against the records.

    H200: PYTHONPATH=pager python3 scripts/gpu_copy_path_probe.py --out $OUT/copy-path.json
    CPU:  TRITON_INTERPRET=1 PYTHONPATH=pager python scripts/gpu_copy_path_probe.py --device cpu --smoke
          (eager, each path run once: checks the wiring and the bytes; its times are not GPU figures)
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "pager"))
from bigmoe_pager.atomic_file import write_atomic  # noqa: E402
from bigmoe_pager.core.acquire_kernel import next_pow2  # noqa: E402
from bigmoe_pager.core.copy_kernel import copy_records  # noqa: E402
from bigmoe_pager.core.host_copier import HostCopier  # noqa: E402
from bigmoe_pager.core.layout import ExpertLayout  # noqa: E402
from bigmoe_pager.core.prefetch_chain import GPU_MAX_SPINS  # noqa: E402
from bigmoe_pager.core.step_kernel import default_programs  # noqa: E402
from bigmoe_pager.core.triton_launch import kernel_for  # noqa: E402

BLOCK = 128  # FP8 block-scale edge of the Qwen checkpoints
BUSY_CHUNK = 64 << 20  # bytes per background copy (about 1.2 ms at 55 GB/s)
BASES = ("sm", "step", "stepflat", "host", "hostwt", "hostflat", "dma", "goal", "flat", "pair", "mixed")
HOSTS = ("host", "hostwt", "hostflat")
"""The paths a host copier thread serves, one thread each."""
BUSY_KINDS = ("busy", "smbusy")  # Background's kinds: copy engines, SM copies
FLAG_WORDS = 8  # core.prefetch_chain's words that publish_round may write (PUBLISHED)

try:
    import triton
    import triton.language as tl
except ImportError:
    triton = tl = None

if triton is not None:
    from bigmoe_pager.core.host_rounds import publish_round
    from bigmoe_pager.core.round_sync import wait_copies

    @triton.jit
    def _publish_and_wait(
        box_ptr,
        flags_ptr,
        seq_ptr,
        rows_ptr,
        slot_ptr,
        target_ptr,
        copied_ptr,
        late_ptr,
        m,
        max_spins,
        S: tl.constexpr,
        BLOCK_S: tl.constexpr,
        ON_GPU: tl.constexpr,
    ):
        # what a step handing its m misses to the host copier would do: raise each slot's goal, publish, wait
        j = tl.arange(0, BLOCK_S)
        listed = j < m
        slots = tl.load(slot_ptr + j, mask=listed, other=0)
        goal = tl.load(target_ptr + slots, mask=listed, other=0, volatile=True) + 1
        tl.store(target_ptr + slots, goal, mask=listed)
        seq = tl.load(seq_ptr, volatile=True) + 1
        tl.store(seq_ptr, seq)
        tl.debug_barrier()
        publish_round(box_ptr, flags_ptr, seq, rows_ptr, slot_ptr, target_ptr, m, S, BLOCK_S, ON_GPU)
        late = wait_copies(copied_ptr, target_ptr, slots, listed, max_spins, ON_GPU)
        tl.atomic_add(late_ptr, tl.sum(late.to(tl.int32), 0))


def _is_weight(component) -> bool:
    """A weight matrix (w13_weight, w2_weight), not a scale block (*_scale_inv)."""
    return component.name.endswith("_weight")


class HostPath:
    """One host copier thread serving one mailbox into the bench's slots, with the words a publishing kernel uses."""

    def __init__(self, device, records, pitch: int, components, slots: int):
        self.device = device
        self.copier = HostCopier(device)
        self.mailbox = HostCopier.mailbox(slots, device)
        self.copied = torch.zeros(slots, dtype=torch.int64, device=device)
        self.target = torch.zeros(slots, dtype=torch.int64, device=device)
        self.flags = torch.zeros(FLAG_WORDS, dtype=torch.int64, device=device)
        self.seq = torch.zeros(1, dtype=torch.int64, device=device)
        self.late = torch.zeros(1, dtype=torch.int32, device=device)  # waits that gave up
        self.copier.add_layer(self.mailbox, records, pitch, components, self.copied, slots)

    def check_serves(self, fn) -> None:
        """Run fn once and raise RuntimeError (one line) if the thread failed or a wait gave up: each of the timed
        calls would then wait about a second (GPU_MAX_SPINS) and the probe would outlast its bounds."""
        fn()
        if self.device.type == "cuda":
            torch.cuda.synchronize()
        stats = self.copier.stats()
        if stats["error"] or int(self.late.item()):
            why = stats.get("error_call") or "a wait gave up"
            raise RuntimeError(f"the host copier did not serve the round (error {stats['error']}: {why})")

    def report(self) -> dict:
        """The thread's counters and the kernel's given-up waits; stops the thread."""
        got = dict(self.copier.stats())
        got["late"] = int(self.late.item())
        self.copier.close()
        return got


class Bench:
    """N experts' worth of records in pinned host memory, their slots on the device, and each path's work."""

    def __init__(self, args, device: torch.device):
        self.device, self.args = device, args
        self.layout = ExpertLayout.for_moe(args.hidden, args.inter, torch.float8_e4m3fn, block=BLOCK)
        self.n_max = max(args.experts)
        pin = device.type == "cuda"
        gen = torch.Generator().manual_seed(0)
        records = torch.randint(0, 256, (self.n_max, self.layout.pitch), dtype=torch.uint8, generator=gen)
        self.records = records.pin_memory() if pin else records
        self.buffers = self.layout.slot_buffers(self.n_max, device)
        self.flat = torch.empty(self.n_max * self.layout.pitch, dtype=torch.uint8, device=device)
        self.slots = torch.arange(self.n_max, dtype=torch.int64, device=device)
        # packed slots (hostflat, stepflat): each slot one run of a record's bytes, the components at their offsets
        self.packed = torch.empty(self.n_max, self.layout.record_bytes, dtype=torch.uint8, device=device)
        self.packed_layout = ExpertLayout.build([("record", (self.layout.record_bytes,), torch.uint8)])
        components = [(c.offset, c.nbytes, self.buffers[c.name]) for c in self.layout.components]
        weights = [served for c, served in zip(self.layout.components, components) if _is_weight(c)]
        packed = [(0, self.layout.record_bytes, self.packed)]  # hostflat: the whole record as one component
        served = {"host": components, "hostwt": weights, "hostflat": packed}
        self.hosts = {
            name: HostPath(device, self.records, self.layout.pitch, served[name], self.n_max)
            for name in HOSTS
            if name in args.paths
        }
        goals = torch.arange(1, self.n_max + 1, dtype=torch.int64)
        self.goals = goals.pin_memory() if pin else goals  # the completion words goal-N copies, from pinned memory
        self.goal_words = torch.zeros(self.n_max, dtype=torch.int64, device=device)
        self.programs = default_programs(device)
        self.side = torch.cuda.Stream(device) if pin else None  # pair-N's and mixed-N's second stream

    def work(self, base: str, n: int) -> None:
        """Enqueue one copy of n experts (records 0..n-1 into slots 0..n-1) by path `base`."""
        idx = self.slots[:n]
        if base in ("sm", "step", "stepflat"):
            per_record = 0 if base == "sm" else max(1, self.programs // n)
            packed = base == "stepflat"
            layout, buffers = (self.packed_layout, {"record": self.packed}) if packed else (self.layout, self.buffers)
            copy_records(self.records, idx, idx, layout, buffers, programs_per_record=per_record)
        elif base in self.hosts:
            on_gpu = self.device.type == "cuda"
            path = self.hosts[base]
            kernel_for(_publish_and_wait, self.device)[(1,)](
                path.mailbox,
                path.flags,
                path.seq,
                idx,
                idx,
                path.target,
                path.copied,
                path.late,
                n,
                GPU_MAX_SPINS if on_gpu else 1 << 20,
                S=self.n_max,
                BLOCK_S=next_pow2(max(2, self.n_max)),
                ON_GPU=on_gpu,
            )
        elif base in ("dma", "goal"):
            for r in range(n):
                for c in self.layout.components:
                    dst = self.buffers[c.name][r].view(-1).view(torch.uint8)
                    dst.copy_(self.records[r, c.offset : c.offset + c.nbytes], non_blocking=True)
                if base == "goal":
                    self.goal_words[r : r + 1].copy_(self.goals[r : r + 1], non_blocking=True)
        elif base == "flat":
            self._flat(0, n)
        elif base in ("pair", "mixed"):
            half = (n + 1) // 2  # the first stream's share; the second takes the rest at the same time
            main = torch.cuda.current_stream(self.device) if self.side is not None else None
            if base == "pair":
                self._flat(0, half)
            else:
                copy_records(self.records, idx[:half], idx[:half], self.layout, self.buffers, programs_per_record=0)
            if half < n:
                if main is None:
                    self._flat(half, n)  # CPU: one stream, one after the other
                else:
                    self.side.wait_stream(main)
                    with torch.cuda.stream(self.side):
                        self._flat(half, n)
                    main.wait_stream(self.side)
        else:
            raise ValueError(f"unknown path {base!r}")

    def _flat(self, first: int, end: int) -> None:
        """Records first..end-1 into the contiguous scratch at their own offsets, as one copy."""
        pitch = self.layout.pitch
        self.flat[first * pitch : end * pitch].copy_(self.records[first:end].view(-1), non_blocking=True)

    def bytes_ok(self, base: str, n: int) -> bool:
        """The path's copies of n experts landed whole: in the slots below n (the packed ones for hostflat and
        stepflat), or in the contiguous scratch for the flat copies (pair-N: all of it; mixed-N: the second half, the
        first in the slots)."""
        if base in ("hostflat", "stepflat"):
            return torch.equal(self.packed[:n].cpu(), self.records[:n, : self.layout.record_bytes].cpu())
        in_slots = {"flat": 0, "pair": 0, "mixed": (n + 1) // 2}.get(base, n)
        pitch = self.layout.pitch
        for c in self.layout.components:
            if base == "hostwt" and not _is_weight(c):
                continue  # its scale blocks are left out by design
            want = self.records[:in_slots, c.offset : c.offset + c.nbytes].cpu()
            have = self.buffers[c.name][:in_slots].reshape(in_slots, c.nbytes // self.buffers[c.name].element_size())
            have = have.view(torch.uint8).cpu()
            if not torch.equal(want, have):
                return False
        return torch.equal(self.flat[in_slots * pitch : n * pitch].cpu(), self.records[in_slots:n].reshape(-1).cpu())

    def clear(self) -> None:
        for buf in self.buffers.values():
            buf.view(torch.uint8).zero_()
        self.flat.zero_()
        self.packed.zero_()


class Dense:
    """A chain of small bf16 kernels: layers x dense of [1, H] x [H, H] and a tanh (vLLM's decode, roughly)."""

    def __init__(self, args, device: torch.device):
        gen = torch.Generator().manual_seed(1)
        self.weights = [
            (torch.randn(args.hidden, args.hidden, generator=gen) / args.hidden**0.5).to(device, torch.bfloat16)
            for _ in range(args.dense)
        ]
        self.x = torch.randn(1, args.hidden, generator=gen).to(device, torch.bfloat16)
        self.layers = args.layers

    def work(self) -> None:
        x = self.x
        for _ in range(self.layers):
            for w in self.weights:
                x = torch.tanh(x @ w)
        self.x.copy_(x)


def time_graph(fn, args, busy: "Background | None") -> float:
    """Microseconds per call of fn, captured --repeat times in one graph replayed --replays times (median of
    --trials); with --eager, the same calls launched one by one, no graph (run 43: on one H100 the graphs' copies
    of two to eight experts ran at half the rate of a plain copy of the same bytes)."""
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        for _ in range(2):
            fn()  # compile and warm before the capture
    torch.cuda.synchronize()
    if args.eager:

        def replay() -> None:  # on the current stream, as a graph replays
            for _ in range(args.repeat):
                fn()

    else:
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=stream):
            for _ in range(args.repeat):
                fn()
        replay = graph.replay
    for _ in range(3):
        replay()
    torch.cuda.synchronize()
    results = []
    for _ in range(args.trials):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        if busy is not None:
            busy.start()
        start.record()
        for _ in range(args.replays):
            replay()
        end.record()
        torch.cuda.synchronize()
        if busy is not None:
            busy.check_outlasted(end)
        results.append(start.elapsed_time(end) * 1000 / (args.replays * args.repeat))
    return statistics.median(results)


class Background:
    """Copies on their own stream that keep the link busy for `seconds`: host-to-device copies of BUSY_CHUNK bytes
    by the copy engines (kind "busy"), or the pager's SM copy kernel moving `bench`'s records into scratch slots
    (kind "smbusy", at the 42-45 GB/s such copies reach)."""

    def __init__(self, device: torch.device, seconds: float, kind: str, bench: "Bench"):
        self.kind, self.bench = kind, bench
        self.stream = torch.cuda.Stream()
        self.done = torch.cuda.Event(enable_timing=True)
        if kind == "busy":
            self.src = torch.empty(BUSY_CHUNK, dtype=torch.uint8).pin_memory()
            self.dst = torch.empty(BUSY_CHUNK, dtype=torch.uint8, device=device)
            self.launches = max(2, int(seconds * 55e9 / BUSY_CHUNK) + 1)
        else:
            self.scratch = bench.layout.slot_buffers(bench.n_max, device)
            self.launches = max(2, int(seconds * 42e9 / (bench.n_max * bench.layout.pitch)) + 1)

    def start(self) -> None:
        with torch.cuda.stream(self.stream):
            for _ in range(self.launches):
                if self.kind == "busy":
                    self.dst.copy_(self.src, non_blocking=True)
                else:
                    idx = self.bench.slots
                    copy_records(self.bench.records, idx, idx, self.bench.layout, self.scratch)
            self.done.record()

    def check_outlasted(self, end: torch.cuda.Event) -> None:
        if end.elapsed_time(self.done) < 0:
            raise BackgroundTooShort("the background copies ended before the timed replays: raise their length")


class BackgroundTooShort(RuntimeError):
    """The timed replays outlasted their background, so part of them ran alone."""


OUTLAST = (2, 8, 32)
"""Backgrounds tried in turn, as multiples of the replays' time alone: a copy beside busy copy engines can take
several times as long (run 29: most rows outlasted twice their time alone)."""


def measure(fn, args, device: torch.device, busy: str | None, bench: "Bench") -> float:
    """Microseconds per call of fn: graphs on a GPU (beside a Background of kind `busy`, OUTLAST times the replays'
    time alone, longer until it outlasts them), one eager call on the CPU."""
    if device.type != "cuda":
        began = time.perf_counter()
        fn()
        return (time.perf_counter() - began) * 1e6
    if busy is None:
        return time_graph(fn, args, None)
    alone_s = time_graph(fn, args, None) * args.replays * args.repeat / 1e6
    for times in OUTLAST[:-1]:
        try:
            return time_graph(fn, args, Background(device, times * alone_s + 0.01, busy, bench))
        except BackgroundTooShort:
            continue  # a longer one
    return time_graph(fn, args, Background(device, OUTLAST[-1] * alone_s + 0.01, busy, bench))


def run(args) -> dict:
    device = torch.device(args.device)
    bench = Bench(args, device)
    report = {
        "command": "gpu_copy_path_probe.py " + " ".join(args.argv),
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu (not a GPU figure)",
        "torch": torch.__version__,
        "expert_bytes": bench.layout.pitch,
        "components": [[c.name, c.nbytes] for c in bench.layout.components],
        "step_programs": bench.programs,
        "repeat": args.repeat,
        "replays": args.replays,
        "timed_as": "eager calls" if args.eager else "graph replays",
        "rows": [],
    }
    dense = Dense(args, device)
    plan = [(base, n) for base in args.paths for n in args.experts] + [("dense", 0)]
    for busy in (None, *args.busy):
        for base, n in plan:
            name = f"{base}-{n}" if n else base
            bench.clear()
            fn = dense.work if base == "dense" else (lambda b=base, k=n: bench.work(b, k))
            row = {"path": name + (f"-{busy}" if busy else ""), "experts": n}
            try:
                if base in bench.hosts:
                    bench.hosts[base].check_serves(fn)
                us = measure(fn, args, device, busy, bench)
            except RuntimeError as err:  # e.g. a copy torch will not capture: the row says so, the others run
                row["error"] = str(err).splitlines()[0][:300]
                report["rows"].append(row)
                print(json.dumps(row), flush=True)
                continue
            row["us"] = round(us, 2)
            if n:
                torch.cuda.synchronize() if device.type == "cuda" else None
                row["us_per_expert"] = round(us / n, 2)
                row["gb_per_s"] = round(n * bench.layout.pitch / us / 1e3, 2)
                row["bytes_ok"] = bench.bytes_ok(base, n)
            report["rows"].append(row)
            print(json.dumps(row), flush=True)
    report["host_copiers"] = {name: path.report() for name, path in bench.hosts.items()}
    return report


def parse(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--hidden", type=int, default=2048, help="hidden size (the 40-layer benchmark's)")
    p.add_argument("--inter", type=int, default=512, help="MoE intermediate size")
    p.add_argument("--experts", default="1,2,4", help="experts a copy moves (comma separated)")
    p.add_argument("--paths", default=",".join(BASES), help=f"copy paths among {', '.join(BASES)}")
    p.add_argument("--layers", type=int, default=40, help="layers of the dense chain")
    p.add_argument("--dense", type=int, default=8, help="small kernels a layer in the dense chain")
    p.add_argument("--repeat", type=int, default=8, help="copies of the work in one graph")
    p.add_argument("--replays", type=int, default=50, help="graph replays timed per trial")
    p.add_argument("--trials", type=int, default=5, help="timed trials (the median is reported)")
    p.add_argument("--eager", action="store_true", help="launch each path's calls one by one instead of as a graph")
    p.add_argument(
        "--busy",
        default=",".join(BUSY_KINDS),
        help=f"backgrounds to time beside, among {', '.join(BUSY_KINDS)} ('': none)",
    )
    p.add_argument("--device", default="cuda", help="cuda, or cpu with --smoke")
    p.add_argument("--smoke", action="store_true", help="tiny shapes, each path once (a wiring check)")
    p.add_argument("--out", type=Path, default=None, help="JSON report path")
    args = p.parse_args(argv)
    args.argv = argv
    try:
        args.experts = [int(x) for x in args.experts.split(",")]
    except ValueError:
        p.error("--experts takes integers, comma separated")
    args.paths = args.paths.split(",")
    args.busy = [kind for kind in args.busy.split(",") if kind]
    if not set(args.busy) <= set(BUSY_KINDS):
        p.error(f"--busy takes {', '.join(BUSY_KINDS)}, comma separated")
    if any(n < 1 for n in args.experts) or not set(args.paths) <= set(BASES):
        p.error(f"--experts are >= 1; --paths are among {', '.join(BASES)}")
    if args.smoke:
        args.hidden, args.inter, args.layers, args.dense = 256, 128, 2, 2
        args.busy = []
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse(sys.argv[1:] if argv is None else argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        print("gpu_copy_path_probe: no CUDA GPU is visible; use --device cpu --smoke to check wiring", file=sys.stderr)
        return 2
    if args.device == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        print("gpu_copy_path_probe: on CPU the kernels need TRITON_INTERPRET=1 set before start", file=sys.stderr)
        return 2
    report = run(args)
    bad = [row["path"] for row in report["rows"] if row.get("bytes_ok") is False]
    if args.out:
        write_atomic(args.out, (json.dumps(report, indent=1) + "\n").encode())
    late = sum(path["late"] for path in report["host_copiers"].values())
    if bad or late:
        print(f"gpu_copy_path_probe: wrong bytes in {bad or 'none'}; {late} waits gave up", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
