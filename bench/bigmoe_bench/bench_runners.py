"""The configurations the paging benchmark compares, all on one MoE compute.

Each runner holds one model's experts its own way and runs `step(layer, ids, x,
w)` for one decode token of one layer: resident (every expert in VRAM), static
offload (whole expert tensors of some layers left in pinned RAM and read over
PCIe by the kernel, as vLLM's --cpu-offload-gb does), bigmoe (ExpertPager: VRAM
slots fed from the RAM tier), and bigmoe with the SSD tier (partial RAM tier
filled by the SSD helper's service from a paging file).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from bigmoe_pager.core.hot_profile import HotProfile
from bigmoe_pager.core.layout import ExpertLayout
from bigmoe_pager.core.pager import ExpertPager
from bigmoe_pager.core.ram_tier import RamTier, ServiceFetch
from bigmoe_pager.core.stats import PagerStats

from bigmoe_bench import moe_ref
from bigmoe_bench.moe_decode import ExpertWeights, moe_decode

BLOCK = 128  # FP8 block-scale edge of the Qwen checkpoints
FP8_NO_NAN = 0xF7  # clearing bit 3 keeps every byte's exponent below 1111: no e4m3fn NaN in random weights


@dataclass(frozen=True)
class ModelShape:
    """Expert shapes of one preset (numbers as in presets/*.toml)."""

    name: str
    """Preset name."""
    layers: int
    """MoE layers of the real model."""
    experts: int
    """Routed experts per layer."""
    top_k: int
    """Experts per token."""
    hidden: int
    """Hidden size."""
    inter: int
    """MoE intermediate size."""
    bench_layers: int
    """Layers the benchmark runs by default (fewer where the machine cannot hold the whole model)."""


MODELS = {
    "qwen3.6-35b-a3b": ModelShape("qwen3.6-35b-a3b", 40, 256, 8, 2048, 512, bench_layers=40),
    "qwen3.8-flash-next": ModelShape("qwen3.8-flash-next", 48, 512, 10, 2560, 640, bench_layers=12),
}
SMOKE = ModelShape("smoke", 3, 32, 4, 128, 64, bench_layers=3)


def make_layout(shape: ModelShape) -> ExpertLayout:
    return ExpertLayout.for_moe(shape.hidden, shape.inter, torch.float8_e4m3fn, block=BLOCK)


def make_ram_tiers(
    shape: ModelShape, layout: ExpertLayout, layers: int, device: torch.device, seed: int
) -> list[RamTier]:
    """Full RAM tiers (pinned on a GPU machine) holding random FP8 experts with small positive scales."""
    gen = torch.Generator(device=device).manual_seed(seed)
    tiers = []
    for _ in range(layers):
        rec = torch.randint(0, 256, (shape.experts, layout.pitch), dtype=torch.uint8, device=device, generator=gen)
        rec &= FP8_NO_NAN
        for name, view in _record_views(rec, layout).items():
            if view.dtype == torch.float32:
                view.fill_(2.0**-8)
        ram = RamTier(layout, shape.experts, shape.experts, device)
        ram.load_all(rec)
        tiers.append(ram)
    if device.type == "cuda":
        torch.cuda.synchronize()
    return tiers


def _record_views(records: torch.Tensor, layout: ExpertLayout) -> dict[str, torch.Tensor]:
    w = ExpertWeights.from_records(records, layout, BLOCK)
    return {
        "w13_weight": w.w13,
        "w2_weight": w.w2,
        "w13_weight_scale_inv": w.w13_scale,
        "w2_weight_scale_inv": w.w2_scale,
    }


def moe(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, experts: ExpertWeights) -> torch.Tensor:
    """The one MoE compute of every configuration (Triton on a GPU, the torch reference on CPU)."""
    if x.device.type == "cuda":
        return moe_decode(x, ids, weights, experts)
    buffers = {
        "w13_weight": experts.w13,
        "w2_weight": experts.w2,
        "w13_weight_scale_inv": experts.w13_scale,
        "w2_weight_scale_inv": experts.w2_scale,
    }
    return moe_ref.moe(x, ids, weights, buffers, experts.block)


class Resident:
    """Every expert of every layer in VRAM."""

    name = "resident"

    def __init__(self, rams: list[RamTier], layout: ExpertLayout, device: torch.device) -> None:
        self.vram_frac, self.ram_frac = 1.0, 1.0
        self.stats = None
        on_device = [r.records.to(device) if device.type == "cuda" else r.records for r in rams]
        self.weights = [ExpertWeights.from_records(rec, layout, BLOCK) for rec in on_device]

    def step(self, layer: int, ids: torch.Tensor, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return moe(x, ids, w, self.weights[layer])


class StaticOffload:
    """vLLM --cpu-offload-gb style: whole expert tensors in VRAM up to the budget, the rest read from pinned RAM.

    The budget is vram_frac of all expert bytes, spent on whole tensors (w13 with its
    scales, w2 with its scales) layer by layer, so it never exceeds bigmoe's.
    """

    name = "static"

    def __init__(self, rams: list[RamTier], layout: ExpertLayout, device: torch.device, vram_frac: float) -> None:
        self.vram_frac, self.ram_frac = vram_frac, 1.0
        self.stats = None
        experts = rams[0].num_experts
        budget = vram_frac * len(rams) * experts * layout.record_bytes
        self.offloaded: list[list[int]] = []  # per layer: bytes per expert of its offloaded tensors
        self.weights = []
        used = 0
        for ram in rams:
            host = _record_views(ram.records, layout)
            staged = None  # the layer's records on the GPU, while its kept tensors are cut out of them
            parts, off = {}, []
            for weight in ("w13_weight", "w2_weight"):
                group = (weight, weight + "_scale_inv")
                size = sum(layout[n].nbytes for n in group) * experts
                keep = used + size <= budget
                used += size if keep else 0
                if keep and device.type == "cuda" and staged is None:
                    staged = _record_views(ram.records.to(device), layout)
                for n in group:
                    parts[n] = staged[n].contiguous() if keep and staged is not None else host[n]
                if not keep:
                    off.append(sum(layout[n].nbytes for n in group))
            del staged
            self.offloaded.append(off)
            self.weights.append(
                ExpertWeights(
                    parts["w13_weight"],
                    parts["w2_weight"],
                    parts["w13_weight_scale_inv"],
                    parts["w2_weight_scale_inv"],
                    BLOCK,
                )
            )
        self.vram_used_frac = used / (len(rams) * experts * layout.record_bytes)
        """Share of expert bytes actually kept in VRAM (whole tensors only)."""

    def step(self, layer: int, ids: torch.Tensor, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return moe(x, ids, w, self.weights[layer])

    def pcie_bytes_per_token(self, trace: np.ndarray) -> float:
        """Bytes the kernel reads over PCIe per token: every distinct expert of a token, in each offloaded tensor."""
        total = 0
        for layer, off in enumerate(self.offloaded):
            if off:
                distinct = sum(len({int(e) for e in row if e >= 0}) for row in trace[:, layer, :])
                total += distinct * sum(off)
        return total / len(trace)


class Bigmoe:
    """The pager: vram_frac of each layer's experts in VRAM slots, RAM tier behind (full, or partial over SSD).

    fused=None: the pager's default (one launch per layer on a GPU over a full RAM tier);
    False: acquire and copy as two launches (the config "bigmoe-unfused", for comparison).
    """

    name = "bigmoe"

    def __init__(
        self,
        rams: list[RamTier],
        layout: ExpertLayout,
        device: torch.device,
        vram_frac: float,
        profile: HotProfile | None = None,
        top_k: int = 1,
        ram_frac: float = 1.0,
        ssd=None,
        store=None,
        policy: str = "lru",
        fused: bool | None = None,
        prefetch_budget: int | None = None,
    ) -> None:
        """prefetch_budget: ExpertPager's (None: the pager's default)."""
        self.vram_frac, self.ram_frac = vram_frac, ram_frac
        self.name = ("bigmoe" if policy == "lru" else f"bigmoe-{policy}") + ("-unfused" if fused is False else "")
        self.policy = policy
        experts = rams[0].num_experts
        slots = max(top_k, round(vram_frac * experts))
        self.stats = PagerStats(len(rams), device)
        self.pagers = []
        for layer, ram in enumerate(rams):
            if ssd is not None:
                ram.attach_ssd(ServiceFetch(ssd, layer))
            pager = ExpertPager(
                layout,
                experts,
                slots,
                ram,
                device=device,
                layer=layer,
                stats=self.stats,
                policy=policy,
                fused=fused,
                prefetch_budget=prefetch_budget,
            )
            if profile is not None:
                hot = torch.from_numpy(profile.hottest(layer))
                read = None if store is None else (lambda e, dst, layer=layer: store.read(layer, e, dst))
                pager.warm(hot, read)
            self.pagers.append(pager)
        self.weights = [ExpertWeights.from_slots(p.buffers, BLOCK) for p in self.pagers]

    predicted = None
    """int32 [tokens, layers, P] on the device: next-layer predictions to prefetch with (None: no prefetch)."""
    _pending: set[int] = frozenset()
    """Layers whose side-stream prefetch the next step must wait for."""

    def step(
        self,
        layer: int,
        ids: torch.Tensor,
        x: torch.Tensor,
        w: torch.Tensor,
        predicted_next: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """One layer: acquire (after this layer's prefetch copies), then prefetch layer + 1 while this one computes."""
        side = self._side
        if layer in self._pending:  # only a pending prefetch: a capture may not wait on work recorded outside it
            torch.cuda.current_stream().wait_stream(side)  # a late prefetch copy is waited for
            self._pending.discard(layer)
        remapped = self.pagers[layer].prepare(ids)
        if predicted_next is not None and layer + 1 < len(self.pagers):
            if side is None:
                self.pagers[layer + 1].prefetch(predicted_next)
            else:
                side.wait_stream(torch.cuda.current_stream())  # layer + 1's last step is done with its slots
                with torch.cuda.stream(side):
                    self.pagers[layer + 1].prefetch(predicted_next)
                self._pending.add(layer + 1)
        return moe(x, remapped, w, self.weights[layer])

    @property
    def _side(self):
        if self.predicted is None or not self.predicted.is_cuda:
            return None
        if getattr(self, "_side_stream", None) is None:
            self._side_stream = torch.cuda.Stream(self.predicted.device)
        return self._side_stream


class PrefetchBigmoe(Bigmoe):
    """Bigmoe whose layer l prefetches layer l+1's predicted experts on a side stream (predictions from the trace)."""

    def __init__(self, *args, predicted: torch.Tensor, recall: float, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.predicted = predicted
        self.recall = recall
        self._pending = set()
        self.name = f"{self.name}-prefetch-r{recall:g}"


def partial_ram_tiers(
    layout: ExpertLayout, experts: int, layers: int, ram_frac: float, device: torch.device, policy: str = "lru"
) -> list[RamTier]:
    slots = round(ram_frac * experts)
    return [RamTier(layout, experts, slots, device, policy=policy) for _ in range(layers)]


def write_paging_file(path: Path, layout: ExpertLayout, rams: list[RamTier]):
    """A paging file holding the records of `rams` (the SSD helper's format); returns its metadata."""
    from bigmoe_pager.core.paging_file import PagingFileMeta, PagingFileWriter

    meta = PagingFileMeta("bench/synthetic", "bench", layout.signature(), len(rams), rams[0].num_experts)
    with PagingFileWriter(path, meta, layout.pitch) as writer:
        for layer, ram in enumerate(rams):
            for expert in range(ram.num_experts):
                writer.add(layer, expert, ram.records[expert])
        writer.commit()
    return meta
