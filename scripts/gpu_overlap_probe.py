"""Where next-layer prefetch spends a decode token's time: one CUDA graph per token, the pager's real parts.

Run 6 (vLLM 0.33, H200) measured prefetch slower than none at every recall: about 0.9 ms a token
(23 us a layer) even at recall 0, where almost nothing is copied. This probe takes the prefetch
path apart on the GPU without vLLM (seconds, not an engine start). Each of --layers layers runs
what vLLM's decode runs, in order:
  1. --dense small bf16 kernels ([1, H] x [H, H], standing in for norms, attention and projections);
  2. the layer's paging (DeviceLayerPager.step: the fused step kernel over a full pinned RAM tier);
  3. the side work for layer l + 1, forked there (LivePredictions.feed_ids or feed, as the vLLM adapter does)
     and joined at layer l + 1's MoE call, after its dense kernels (as in vLLM's FULL graphs);
  4. the MoE compute over the slots (bigmoe_bench's Triton decode kernel).
Routing replays a family trace; predictions are a top-k predictor's at each recall.

Side work (--variants), each adding one part of the prefetch path:
  none         the plain pager
  fork         fork and join only, nothing on the side stream
  kN           fork, N trivial kernels on the side stream (a one-element add each), join: what a branch of N graph
               nodes costs the main stream apart from what the nodes do (k1 against k3: the branch against its nodes)
  gather       the replayed proposal's gather (core.prediction.replayed_rows: one kernel on CUDA, as
               ReplayedPredictions.rows in vLLM)
  admit        gather + the admit decision (SlotTable.admit), no copy
  inline       gather + the admit decision on the main stream, right after the step (no fork, no copy): what a
               round's decision costs on the critical path (BIGMOE_PREFETCH_HOST_COPIER without the one-node kernel
               decides there)
  prefetch     gather + admit + copy, one copy program per 8 KiB block (every SM while it runs)
  prefetch-pN  the same, at most N copy programs per expert (copy_records' programs_per_record)
  router       a live proposal instead of the replayed one: LivePredictions.feed (predict_next, a GEMV of the
               layer's hidden state by layer l + 1's router weight, then a top-k) + admit + copy into layer
               l + 1's pager, as BIGMOE_PREDICT=router runs it. The router weights are random bf16 [experts,
               hidden]: the proposals are near random, so this is the live path's fixed cost at low recall (the
               prefetch gate may close for most rounds), not what a trained router's proposals would save
  router-pN    the same, at most N copy programs per expert
  onenode      the one-node kernel with the host copier, as `+one-node+host` runs in vLLM: one program forked after the
               first layer's step decides every later layer's round once the step before it is done and publishes it
               to the host copier's thread (BIGMOE_PREFETCH_ONE_NODE + BIGMOE_PREFETCH_HOST_COPIER), joined at the
               token's end; -bare launches no kernel at all (the joinless steps and the token's drain alone: with no
               round run, every token after the first is quiet, so its steps settle nothing; core.prefetch_chain).
               Off CUDA the kernel is launched once a layer, after its step
Suffixes on any variant that forks: -hi runs the side stream at high priority (BIGMOE_PREFETCH_HIGH_PRIORITY);
-late joins once, at the end of the token (kN only: a step would read slots a copy may still write), to see what
the per-layer join costs apart from the fork; -once forks once, at the first layer, with every layer's N kernels
(kN only), joined at the end of the token: a side chain that waits on no layer;
-joinnow joins at the end of layer l's MoE call instead (where vLLM's PIECEWISE pieces must join), to see what
the deferred join buys.
plus `resident` (every expert in VRAM, no paging) for the floor. Timed with CUDA events over
--tokens replays after a warm-up; the VRAM hit rate and PCIe bytes come from the pager's counters.
--profile-tokens N adds each variant's kernel timeline per token (bigmoe_bench.kernel_timeline), the
same summary gpu_vllm_bench.py --profile-tokens gives inside vLLM, to compare the two. On a GPU it is refused
beside onenode at a recall above 0: once torch.profiler has run in a process, those runs crawl (runs 36-37).
A run whose queued tokens are not done --stall-after seconds after the host enqueued them (run 36: onenode at recall
0.8 never finished its warm-up) ends the probe with exit 3 and a last row `stalled`: the prefetch chain's words, the
host copier's counters and each rounds layer's copies under way, claim, gate scores and mailbox, read twice 2 s apart
beside the stuck work, so the next call knows which wait held.

    H200: PYTHONPATH=pager:bench python scripts/gpu_overlap_probe.py --out $OUT/overlap.json
    CPU:  PYTHONPATH=pager:bench python scripts/gpu_overlap_probe.py --device cpu --smoke (eager, no streams:
          checks the wiring and the counters, times nothing worth reading)
"""

from __future__ import annotations

import argparse
import faulthandler
import json
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from bigmoe_bench import traces
from bigmoe_bench.bench_runners import moe
from bigmoe_bench.kernel_timeline import summarize_file
from bigmoe_bench.moe_decode import ExpertWeights
from bigmoe_bench.stall_report import Stalled, finished_within, stall_words
from bigmoe_pager.atomic_file import write_atomic
from bigmoe_pager.core.device_layer import DeviceLayerPager
from bigmoe_pager.core.forward_rounds import ForwardRounds
from bigmoe_pager.core.host_copier import HostCopier
from bigmoe_pager.core.host_pager import TierSizes
from bigmoe_pager.core.host_rounds import drain_published, progress_words, serve_pager
from bigmoe_pager.core.layout import ExpertLayout
from bigmoe_pager.core.prediction import LivePredictions, replayed_rows
from bigmoe_pager.core.prefetch_chain import LATE, RESUME, TIMEOUTS, PrefetchChain
from bigmoe_pager.core.slots import POLICIES
from bigmoe_pager.core.stats import HITS, LOOKUPS, VRAM, PagerStats

BLOCK = 128  # FP8 block-scale edge of the Qwen checkpoints


def main(argv: list[str] | None = None) -> int:
    args = _parse(argv)
    device = torch.device(args.device)
    if device.type == "cuda" and args.profile_tokens and _prefetching_host_rounds(args) and not args.profile_anyway:
        print(
            "gpu_overlap_probe: --profile-tokens with onenode at a recall above 0 stalls on a GPU (runs 36-37: after "
            "torch.profiler in a process, the host-copied rounds' waits give up a second each); time those in a "
            "process without --profile-tokens (or reproduce the stall with --profile-anyway)",
            file=sys.stderr,
        )
        return 2
    if device.type == "cuda" and not torch.cuda.is_available():
        print("gpu_overlap_probe: no CUDA GPU is visible; use --device cpu --smoke to check wiring", file=sys.stderr)
        return 2
    try:
        for name in args.variants.split(","):
            Variant.parse(name)
    except ValueError as e:
        print(f"gpu_overlap_probe: {e}; variants are base[-pN][-hi][-joinnow]", file=sys.stderr)
        return 2
    if args.smoke:
        args.layers, args.experts, args.top_k, args.hidden, args.inter = 3, 32, 4, 128, 64
        args.slots, args.dense, args.warmup, args.tokens = 12, 2, 4, 8
    layout = ExpertLayout.for_moe(args.hidden, args.inter, torch.float8_e4m3fn, block=BLOCK)
    report = {
        "command": " ".join(["gpu_overlap_probe.py"] + (argv if argv is not None else sys.argv[1:])),
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "torch": torch.__version__,
        "layers": args.layers,
        "experts": args.experts,
        "slots": args.slots,
        "eviction": args.eviction,
        "gate": args.gate,
        "prefetch_budget": args.prefetch_budget,
        "expert_mib": round(layout.record_bytes / 2**20, 3),
        "runs": [],
    }
    start = time.perf_counter()
    model = Model(args, layout, device)
    report["setup_s"] = round(time.perf_counter() - start, 1)
    for family in args.families.split(","):
        rows = max(args.trace_rows, args.warmup + args.tokens + args.profile_tokens)  # the position only advances
        trace = traces.named_trace(family, rows, args.layers, args.experts, args.top_k, args.seed)
        trace_dev = torch.from_numpy(trace).to(device=device, dtype=torch.int64)
        order = _hottest(trace[: args.warmup])
        ms, _, profile = model.time(trace_dev, None, "resident", order, args)
        resident = {"family": family, "variant": "resident", "recall": None, "ms_per_token": ms}
        if profile is not None:
            resident["profile"] = profile
        report["runs"].append(resident)
        guesses: dict[float, torch.Tensor] = {}
        for variant in args.variants.split(","):
            base = Variant.parse(variant).base
            recalls = (
                [None]
                if base in ("none", "fork", "router") or _trivial(base)
                else [float(r) for r in args.recalls.split(",")]
            )
            for recall in recalls:
                if recall is not None and recall not in guesses:
                    guess = traces.predictions(trace, recall, None, args.experts, args.seed)
                    guesses[recall] = torch.from_numpy(guess).to(device)
                predicted = None if recall is None else guesses[recall]
                print(f"gpu_overlap_probe: {family} {variant} recall {recall}", file=sys.stderr, flush=True)
                if args.dump_after:  # where a variant that never ends waits (session 28 saw two such runs)
                    faulthandler.dump_traceback_later(args.dump_after, repeat=True)
                try:
                    ms, counted, profile = model.time(trace_dev, predicted, variant, order, args)
                except Stalled as stall:
                    _keep(
                        report, {"family": family, "variant": variant, "recall": recall, "stalled": stall.state}, args
                    )
                    print(f"gpu_overlap_probe: {family} {variant} at recall {recall} stalled", file=sys.stderr)
                    return 3
                finally:
                    faulthandler.cancel_dump_traceback_later()
                row = {"family": family, "variant": variant, "recall": recall, "ms_per_token": ms, **counted}
                row["worst_token_ms"] = model.worst_ms
                if profile is not None:
                    row["profile"] = profile
                _keep(report, row, args)
    report["total_s"] = round(time.perf_counter() - start, 1)
    if args.out:
        _write(args.out, report)
    return 0


def _prefetching_host_rounds(args) -> bool:
    """Whether a variant whose rounds the host copier copies runs at a recall that prefetches (above 0)."""
    hosts = any(Variant.parse(v).base in HOST_ROUNDS for v in args.variants.split(","))
    return hosts and any(float(r) > 0 for r in args.recalls.split(","))


BASES = ("resident", "none", "fork", "gather", "admit", "inline", "prefetch", "router", "onenode")
HOST_ROUNDS = ("onenode",)
"""Variants whose rounds the host copier's thread copies (HostRounds)."""


@dataclass(frozen=True)
class Variant:
    """A --variants name taken apart: base[-pN][-hi][-joinnow]."""

    base: str
    """One of BASES, or kN."""
    programs: int = 0
    """Copy programs per prefetched expert (0: one per block)."""
    high_priority: bool = False
    """The side stream at high priority."""
    join_now: bool = False
    """Joined at the end of the forking layer's MoE call, not at the next layer's."""
    once: bool = False
    """kN: one fork per token, at the first layer, with every layer's kernels (timing only)."""
    late: bool = False
    """Joined once per token, after the last layer (timing only: nothing orders a step after its prefetch)."""
    bare: bool = False
    """onenode: no kernel launched, the joinless steps and the drain only (timing only: nothing is prefetched)."""

    @classmethod
    def parse(cls, name: str) -> "Variant":
        base, *parts = name.split("-")
        if base not in BASES and not _trivial(base):
            raise ValueError(f"unknown variant {name!r}")
        programs, flags = 0, set()
        for part in parts:
            if part.startswith("p") and part[1:].isdigit() and base in ("prefetch", "router"):
                programs = int(part[1:])
            elif part in ("hi", "joinnow") or (part in ("late", "once") and _trivial(base)):
                flags.add(part)
            elif part == "bare" and base == "onenode":
                flags.add(part)
            else:
                raise ValueError(f"unknown part {part!r} of variant {name!r}")
        return cls(
            base,
            programs,
            high_priority="hi" in flags,
            join_now="joinnow" in flags,
            once="once" in parts,
            late="late" in parts or "once" in parts,
            bare="bare" in flags,
        )


class Model:
    """Dense weights, resident experts, a random router weight and a DeviceLayerPager per layer (over a full pinned
    RAM tier)."""

    def __init__(self, args, layout: ExpertLayout, device: torch.device) -> None:
        self.args, self.layout, self.device = args, layout, device
        gen = torch.Generator(device=device).manual_seed(args.seed)
        h = args.hidden
        self.dense = [
            torch.randn((h, h), generator=gen, device=device, dtype=torch.bfloat16) / h**0.5 for _ in range(args.dense)
        ]
        self.resident = []
        self.stats = PagerStats(args.layers, device)
        self._scratch = torch.zeros(1, dtype=torch.int32, device=device)  # the kN variants' side kernels add to it
        self.pagers: list[DeviceLayerPager] = []
        sizes = TierSizes(args.experts, args.slots, args.experts)
        for layer in range(args.layers):
            rec = torch.randint(0, 0x78, (args.experts, layout.pitch), dtype=torch.uint8, device=device, generator=gen)
            for c in layout.components:  # FP8 bytes below 0x78 are finite; scales a small power of two
                if c.dtype == torch.float32:
                    rec[:, c.offset : c.offset + c.nbytes].view(torch.float32).fill_(2.0**-8)
            self.resident.append(ExpertWeights.from_records(rec, layout, BLOCK))
            pager = DeviceLayerPager(
                layout,
                sizes,
                device,
                layer=layer,
                stats=self.stats,
                policy=args.eviction,
                prefetch_gate=args.gate,
                prefetch_budget=args.prefetch_budget,
            )
            pager.ram.records.copy_(rec)
            for e in range(args.experts):
                for c in layout.components:
                    pager.mark_loaded(e, c.name)
            self.pagers.append(pager)
        self.buffers = [layout.slot_buffers(args.slots, device) for _ in range(args.layers)]
        self.slots = [ExpertWeights.from_slots(b, BLOCK) for b in self.buffers]
        # The router variant's [experts, H] gate weights, bf16 as a checkpoint's (random: near random proposals);
        # drawn last, so the other weights stay those of earlier runs.
        self.routers = [
            torch.randn((args.experts, h), generator=gen, device=device, dtype=torch.bfloat16)
            for _ in range(args.layers)
        ]
        _sync(device)

    def restart(self, order: list[list[int]], prefetch_programs: int) -> None:
        """Fresh slot tables (VRAM warmed with the warm-up's hottest experts) and zeroed counters, same records."""
        for layer, pager in enumerate(self.pagers):
            hottest = order[layer]
            pager.order = hottest + [e for e in range(self.args.experts) if e not in set(hottest)]
            pager.pager = None
            pager.start(self.buffers[layer])
            pager.pager.prefetch_programs = prefetch_programs
            pager.pager.step_programs = self.args.step_programs or pager.pager.step_programs
        self.stats.reset()
        _sync(self.device)

    def time(self, trace_dev, predicted, name: str, order, args) -> tuple[float, dict, dict | None]:
        """One variant: ms a timed token, its counters, and with --profile-tokens its profile, taken while its
        host copier still serves (until session 47 it profiled after closing the copier, where every copy a round
        published would have waited a second)."""
        variant = Variant.parse(name)
        if variant.base != "resident":
            self.restart(order, variant.programs)
        rounds = HostRounds(self, predicted, variant) if variant.base in HOST_ROUNDS else None
        try:
            ms = self._time(trace_dev, predicted, variant, rounds, args)
            counted = self.counters()  # before the profiled tokens move them
            profile = self.profile(args.profile_tokens, rounds) if args.profile_tokens else None
            return ms, counted, profile
        finally:
            if rounds is not None:
                rounds.close()

    def _time(self, trace_dev, predicted, variant, rounds, args) -> float:
        live = LivePredictions(LivePredictions.HIGH_PRIORITY if variant.high_priority else 0)
        pos = torch.zeros(1, dtype=torch.int64, device=self.device)
        x0 = torch.randn((args.dense_rows, args.hidden), device=self.device, dtype=torch.bfloat16)
        w = torch.full((1, args.top_k), 1.0 / args.top_k, device=self.device, dtype=torch.float32)

        def token() -> None:
            x = x0
            ids_all = trace_dev.index_select(0, pos)[0]
            if rounds is not None:
                rounds.replayed(pos)
            for layer in range(args.layers):
                for d in self.dense:
                    x = x @ d
                rows, x = x, x[:1]  # (the dense chain's extra rows stand in for kernels that fill the SMs)
                if not variant.late:
                    live.join(self.device)  # where vLLM's FULL graphs join: the MoE call, after attention and routing
                ids = ids_all[layer : layer + 1]
                if variant.base == "resident":
                    out = moe(x, ids, w, self.resident[layer])
                else:
                    slot_ids = self.pagers[layer].step(ids, None if rounds is None else rounds.signal(layer))
                    if rounds is not None:
                        rounds.stepped(layer)
                    if variant.once and layer == 0:
                        self._fork(live, f"k{int(variant.base[1:]) * (args.layers - 1)}", predicted, pos, layer, x)
                    elif layer + 1 < args.layers and variant.base not in ("none", *HOST_ROUNDS) and not variant.once:
                        self._fork(live, variant.base, predicted, pos, layer, x)
                    out = moe(x, slot_ids, w, self.slots[layer])
                    if variant.join_now:
                        live.join(self.device)
                x = (x.float() + out).to(torch.bfloat16)
                if args.dense_rows > 1:
                    x = torch.cat([x, rows[1:]])
            live.join(self.device)
            if rounds is not None:
                rounds.drain()
            pos.add_(1)

        self._timed = variant.base != "resident"
        self.host = {}
        if self.device.type != "cuda":
            self._replay = token
            return self._time_eager(token, pos, args, rounds)
        for _ in range(2):  # Triton compiles outside the capture
            token()
        self._finish(rounds, "compiling tokens")
        if rounds is not None:
            rounds.compiled()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            token()
        pos.zero_()
        for _ in range(args.warmup):
            graph.replay()
        self._finish(rounds, "warm-up")
        self.stats.reset()
        if rounds is not None:
            rounds.mark()
        marks = [torch.cuda.Event(enable_timing=True) for _ in range(args.tokens + 1)]
        marks[0].record()
        for mark in marks[1:]:
            graph.replay()
            mark.record()
        self._finish(rounds, "timed tokens")
        self._replay = graph.replay
        per_token = [a.elapsed_time(b) for a, b in zip(marks, marks[1:])]
        self.worst_ms = round(max(per_token), 4)
        if rounds is not None:
            rounds.check()
            self.host = rounds.summary(args.tokens)
        return round(marks[0].elapsed_time(marks[-1]) / args.tokens, 4)

    def _finish(self, rounds, phase: str) -> None:
        """Wait for every queued token; past --stall-after seconds, raise Stalled with what the chain and the host
        copier say."""
        done = torch.cuda.Event()
        done.record()
        if self.args.stall_after > 0 and not finished_within(done.query, self.args.stall_after):
            first = stall_words(rounds, self.device)
            time.sleep(2.0)
            raise Stalled(
                {
                    "phase": phase,
                    "after_s": self.args.stall_after,
                    "words": first,
                    "words_2s_later": stall_words(rounds, self.device),
                }
            )
        torch.cuda.synchronize()

    def profile(self, tokens: int, rounds) -> dict:
        """The timed variant's next `tokens` tokens under torch.profiler, per stream (kernel_timeline): the main
        stream's idle time while the side stream works is what the join waited; CPU runs have no kernels."""
        cuda = self.device.type == "cuda"
        activity = torch.profiler.ProfilerActivity.CUDA if cuda else torch.profiler.ProfilerActivity.CPU
        with tempfile.TemporaryDirectory() as tmp:
            path = Path(tmp) / "trace.json"
            with torch.profiler.profile(activities=[activity]) as prof:
                for _ in range(tokens):
                    self._replay()
                if cuda:
                    self._finish(rounds, "profiled tokens")
            prof.export_chrome_trace(str(path))
            return summarize_file(path, tokens)

    def _time_eager(self, token, pos, args, rounds) -> float:
        for _ in range(args.warmup):
            token()
        self.stats.reset()
        if rounds is not None:
            rounds.mark()
        times = [time.perf_counter()]
        for _ in range(args.tokens):
            token()
            times.append(time.perf_counter())
        self.worst_ms = round(max(b - a for a, b in zip(times, times[1:])) * 1e3, 4)
        if rounds is not None:
            self.host = rounds.summary(args.tokens)
        return round((times[-1] - times[0]) * 1e3 / args.tokens, 4)

    def _fork(self, live: LivePredictions, variant: str, predicted, pos, layer: int, x) -> None:
        nxt = self.pagers[layer + 1]

        def gather() -> torch.Tensor:
            return replayed_rows(predicted, pos, 0, 0, layer, 1)

        if variant == "router":
            live.feed(x, self.routers[layer + 1], self.args.top_k, nxt)
        elif variant == "fork":
            live.feed_ids(lambda: None, nxt, x)
        elif _trivial(variant):
            live.feed_ids(lambda: [self._scratch.add_(1) for _ in range(int(variant[1:]))] and None, nxt, x)
        elif variant == "gather":
            live.feed_ids(lambda: (gather(), None)[1], nxt, x)
        elif variant in ("admit", "inline"):
            row, nbytes = self.stats.row(layer + 1, "vram"), self.layout.record_bytes

            def decide() -> None:
                nxt.pager.vram.admit(gather(), None, row, nbytes)

            if variant == "inline":
                decide()
            else:
                live.feed_ids(decide, nxt, x)
        else:
            live.feed_ids(gather, nxt, x)

    def counters(self) -> dict:
        if not self._timed:
            return {}
        c = self.stats.read()
        vram = c[:, VRAM]
        moved = sum(p.counters(c)["ram"].bytes_moved for p in self.pagers)
        prefetched = sum(p.counters(c)["vram"].prefetched for p in self.pagers)
        tokens = self.args.tokens
        return {
            "vram_hit": round(float(vram[:, HITS].sum() / max(1, vram[:, LOOKUPS].sum())), 4),
            "pcie_gb_per_token": round(moved / tokens / 1e9, 5),
            "prefetched_per_token": round(prefetched / tokens, 2),
            **self.host,
        }


class HostRounds:
    """The rounds the host copier's thread copies (onenode): the chain's flags, the replay cursors the rounds
    read, the rounds' address table and mailboxes (layers 1 .. L-1), and the host copier serving them."""

    def __init__(self, model: "Model", predicted: torch.Tensor, variant: Variant) -> None:
        layers = model.args.layers
        device = model.device
        for each in model.pagers:  # fused steps (a GPU's default; the interpreter's --smoke needs asking)
            each.pager_started().fused = each.pager_started().vram.use_kernel = True
        self.pagers = pagers = [p.pager_started() for p in model.pagers[1:]]
        self.chain = PrefetchChain(layers, device)
        self.cursor = torch.zeros(layers, dtype=torch.int64, device=device)
        self.slots = pagers[0].num_slots
        self.boxes = boxes = HostCopier.mailbox(self.slots, device, len(pagers))
        self.bare = variant.bare
        self._compiling = True
        """onenode on CUDA: the first token launches no kernel. Launched then, it would wait for each later step
        while the host compiles the kernels before them, giving up after a second each (up to a second a layer)."""
        if device.type == "cuda":  # one kernel a forward; off CUDA one a layer (see the docstring)
            self.rounds = [ForwardRounds(pagers, 1, predicted, self.cursor, 1, boxes, 0)]
        else:
            self.rounds = [
                ForwardRounds([p], i + 1, predicted, self.cursor, 1, boxes[i : i + 1], i) for i, p in enumerate(pagers)
            ]
        self.side = torch.cuda.Stream(device) if device.type == "cuda" and not self.bare else None
        self.copier = HostCopier(device)
        for pager, box in zip(pagers, boxes):
            serve_pager(self.copier, pager, box)
        self.words = progress_words(pagers, device)
        self.layers = layers
        self.tolerate_timeouts = model.args.profile_anyway
        """--profile-anyway: waits that gave up are counted in the row (`timeouts`), not an error: a late copy's
        cost is what such a run measures (runs 36-38)."""

    def replayed(self, pos: torch.Tensor) -> None:
        """Every layer's cursor past the token's row, as the routing replay leaves it before each step."""
        torch.add(pos.expand(self.layers), 1, out=self.cursor)

    def signal(self, layer: int):
        return self.chain.signal(layer, first=layer == 0, joinless=True)

    def stepped(self, layer: int) -> None:
        """onenode, after layer `layer`'s step: on CUDA the forward's kernel forked after the first step; off CUDA
        the next layer's round."""
        if self.bare:
            return
        if self.side is None:
            if layer + 1 < self.layers:
                self.rounds[layer].launch(self.chain.flags, 1)
        elif layer == 0 and self._compiling:  # the token that compiles the steps and the drain runs without it
            self._compiling = False
        elif layer == 0:
            self.side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(self.side):
                self.rounds[0].launch(self.chain.flags, 1)

    def mark(self) -> None:
        """Before the timed tokens: the rounds the host copier has served so far."""
        time.sleep(0.05)  # (no step waits for an empty round: let the thread read the last ones)
        self._served = self.copier.stats()["rounds"]

    def summary(self, tokens: int) -> dict:
        """Rounds the host copier served per timed token (empty ones too), the layers whose prefetch gate is closed
        now, the waits that gave up since the compiling tokens (the warm-up's and the timed tokens') and the drains
        that found a host copy late (each prefetch_chain.LATE_LIMIT-th holds the rounds back)."""
        time.sleep(0.05)
        served = self.copier.stats()["rounds"] - self._served
        closed = sum(not p.vram.gate_is_open() for p in self.pagers)
        chain = self.chain
        return {
            "rounds_per_token": round(served / tokens, 2),
            "gates_closed": closed,
            "timeouts": chain.timeouts,
            "late_drains": chain.late,
        }

    def compiled(self) -> None:
        """After the eager tokens that compile the kernels: any wait they gave up, and any drain that found a copy late
        there (and the hold-back it started), is forgotten (`check` judges the warm-up's and timed tokens')."""
        self.chain.flags[TIMEOUTS] = self.chain.flags[LATE] = self.chain.flags[RESUME] = 0

    def drain(self) -> None:
        """A forward's end, as the predictor ends one: the side stream joined, the host's copies drained, and the
        next forward declared quiet or not (core.prefetch_chain; `bare`'s forwards, where no round runs, all are)."""
        if self.side is not None:
            torch.cuda.current_stream().wait_stream(self.side)
        drain_published(self.words, self.slots, self.chain.flags)
        self.chain.end_forward()

    def check(self) -> None:
        """No wait gave up (unless tolerated) and the host copier reports no error."""
        served = self.copier.stats()
        if (self.chain.timeouts and not self.tolerate_timeouts) or served["error"]:
            raise RuntimeError(f"host rounds: {self.chain.timeouts} waits gave up; host copier {served}")

    def close(self) -> None:
        self.copier.close()


def _trivial(base: str) -> bool:
    """Whether a variant's base is kN (N trivial side kernels)."""
    return base[:1] == "k" and base[1:].isdigit() and int(base[1:]) > 0


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _hottest(trace: np.ndarray) -> list[list[int]]:
    """Per layer, experts by descending use in `trace` [tokens, layers, k]."""
    out = []
    for layer in range(trace.shape[1]):
        counts = np.bincount(trace[:, layer].reshape(-1), minlength=1)
        out.append([int(e) for e in np.argsort(-counts, kind="stable") if counts[e] > 0])
    return out


def _keep(report: dict, row: dict, args) -> None:
    """A finished row: into the report, on stdout, and on disk at once (a run that never ends, as in run 36, keeps
    the rows before it)."""
    report["runs"].append(row)
    print(json.dumps(row), flush=True)
    if args.out:
        _write(args.out, report)


def _write(path: str, report: dict) -> None:
    """The report so far, replacing the last one whole (a run cut short keeps what it finished)."""
    write_atomic(Path(path), (json.dumps(report, indent=1) + "\n").encode())


def _parse(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--layers", type=int, default=40, help="MoE layers (40: the vLLM benchmark's checkpoint)")
    p.add_argument("--experts", type=int, default=256, help="experts per layer")
    p.add_argument("--top-k", type=int, default=8, help="experts per token")
    p.add_argument("--hidden", type=int, default=2048, help="hidden size")
    p.add_argument("--inter", type=int, default=512, help="MoE intermediate size")
    p.add_argument("--slots", type=int, default=102, help="VRAM slots per layer")
    p.add_argument(
        "--eviction",
        default="lru",
        choices=POLICIES,
        help="the pager's eviction (lru: what runs 6-11 probed; vLLM's default is the settings' lfu-duel)",
    )
    p.add_argument(
        "--gate",
        type=int,
        default=None,
        choices=range(101),
        metavar="0-100",
        help="the VRAM prefetch gate's threshold, percent (default: the pager's, slots.MIN_USED_PERCENT)",
    )
    p.add_argument(
        "--prefetch-budget",
        type=int,
        default=None,
        help="experts a prefetch round copies at most (0: no limit; default: the pager's, slots.PREFETCH_BUDGET)",
    )
    p.add_argument(
        "--step-programs", type=int, default=0, help="programs of the fused step's launch (0: the pager's, two a SM)"
    )
    p.add_argument("--dense", type=int, default=16, help="small dense kernels per layer before its MoE")
    p.add_argument(
        "--dense-rows",
        type=int,
        default=1,
        help="rows of the dense kernels ([R, H] x [H, H]; 1: GEMVs, 64: GEMMs that fill the SMs as vLLM's mostly do)",
    )
    p.add_argument("--families", default="standard,topic-shift", help="routing families of scripts/traces.py")
    p.add_argument(
        "--variants", default="none,fork,gather,admit,prefetch,prefetch-p16,prefetch-p16-hi,prefetch-p16-joinnow"
    )
    p.add_argument("--recalls", default="0,0.8,1.0", help="top-k predictor recalls for the variants that gather")
    p.add_argument("--warmup", type=int, default=64, help="tokens replayed before timing (and the hot profile)")
    p.add_argument("--tokens", type=int, default=256, help="tokens timed")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--trace-rows",
        type=int,
        default=0,
        help="rows of each routing trace (its content follows the count; default and at least: warm-up + tokens + "
        "profiled tokens)",
    )
    p.add_argument(
        "--profile-tokens",
        type=int,
        default=0,
        help="after timing, this many tokens under torch.profiler per variant (row 'profile': per-stream kernel time)",
    )
    p.add_argument(
        "--profile-anyway",
        action="store_true",
        help="profile beside onenode at a recall above 0 all the same (to reproduce runs 36-37's stall)",
    )
    p.add_argument("--device", default="cuda", help="cuda, or cpu with --smoke")
    p.add_argument("--smoke", action="store_true", help="tiny shapes and few tokens (a wiring check)")
    p.add_argument(
        "--dump-after",
        type=float,
        default=60.0,
        help="seconds a variant may run before every thread's Python stack is printed to stderr (again each period; "
        "0: never)",
    )
    p.add_argument(
        "--stall-after",
        type=float,
        default=60.0,
        help="seconds queued tokens may take to finish before the run is reported stalled, exit 3 (0: wait)",
    )
    p.add_argument("--out", default=None, help="JSON report path")
    args = p.parse_args(argv)
    if args.prefetch_budget is not None and args.prefetch_budget < 0:
        p.error(f"--prefetch-budget takes a number of experts >= 0 (0: no limit), got {args.prefetch_budget}")
    return args


if __name__ == "__main__":
    sys.exit(main())
