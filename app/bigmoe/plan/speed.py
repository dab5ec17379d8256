"""plan_speed: the link speeds and hit rates behind a plan's expected TPOT, and the estimate.

Every number here is either a specification (PCIe per-lane rates), an assumption that
the plan names as such, a constant fitted to the H200 measurements in docs/bench (named with
its source), or a link speed the probe measured on this machine (links.py), which replaces
the assumption and is named as measured.

The model (checked against every committed H200 measurement by tests/unit/test_plan_speed.py):
TPOT = a step's fixed cost + a per-layer cost + resident bytes at memory bandwidth
     + VRAM misses x expert bytes at the paged-copy rate
     + (with an SSD tier) RAM misses x SSD bytes at the disk's rate + a per-layer wait on the read service
     + (compressed SSD records) RAM misses x raw bytes at the CPU expansion rate of the reader threads.
Nothing overlaps today (each layer waits for its own misses), so the terms add. Hit rates come
from the pager's own eviction code replayed over routing families (HIT_CURVES): the optimistic
end assumes the standard family, the pessimistic end the topic-shift family.
"""

from __future__ import annotations

from dataclasses import dataclass

from bigmoe.machine.hardware import NOT_MEASURED, Disk, Gpu, Unknown

GB = 1e9
MS_PER_S = 1000.0

PCIE_GBPS_PER_LANE = {1: 0.25, 2: 0.5, 3: 0.985, 4: 1.969, 5: 3.938, 6: 7.563}
"""GB/s per lane and direction after line coding, from the PCIe specifications."""
PCIE_EFFICIENCY = 0.8
"""Assumed share of the link a pinned host-to-device copy reaches."""
ASSUMED_PCIE = (4, 16)
"""(generation, lanes) assumed when NVML cannot say."""
DISK_GBPS = {"nvme": 3.0, "sata": 0.5, "hdd": 0.15, "virtual": 1.0}
"""Assumed read speed (GB/s) of multi-MiB O_DIRECT reads at a few in flight, per disk kind."""
UNKNOWN_DISK_GBPS = 0.5
"""Assumed read speed (GB/s) of a disk whose kind is unknown."""
KNOWN_GPUS = {
    "H200": (140, 4800),
    "H100": (80, 3350),
    "A100": (80, 2039),
    "L40S": (48, 864),
    "5090": (32, 1792),
    "4090": (24, 1008),
    "4080": (16, 717),
    "4070": (12, 504),
    "4060": (8, 272),
    "3090": (24, 936),
    "3080": (10, 760),
    "3070": (8, 448),
    "3060": (12, 360),
}
"""Name fragment -> (VRAM GiB, memory bandwidth GB/s), from the vendors' data sheets."""
ASSUMED_GPU_GBPS = 500.0
"""Memory bandwidth (GB/s) assumed for a GPU not in KNOWN_GPUS."""
CPU_GBPS = 20.0
"""Assumed memory bandwidth (GB/s) one CPU decode step reaches."""
DECODE_EFFICIENCY = 0.6
"""Assumed share of memory bandwidth a decode step reaches on resident weights."""
STEP_OVERHEAD_MS = {"cuda": 2.1, "cpu": 5.0}
"""Per-token cost outside weight reads (scheduler, sampling, launches), ms. cuda: fitted to vLLM 0.25.1 on
the H200 under CUDA graphs, unpaged (2.16 ms at 2 layers, 3.85 ms at 40: docs/bench/vllm-gpu); cpu: assumed."""
GRAPH_LAYER_MS = 0.022
"""Per-layer cost of a decode step replayed in CUDA graphs beyond its weight reads, ms (same fit)."""
EAGER_LAYER_MS = 1.4
"""Extra ms per decoder layer and token when vLLM runs eager instead of replaying CUDA graphs: measured
on the H200 with vLLM 0.25.1, unpaged, 2 layers (TPOT 4.92 eager vs 2.16 ms, docs/benchmarks.md)."""
PAGED_COPY_SHARE = 0.78
"""Share of the measured pinned host-to-device rate that a decode step's expert copies reach: the H200 runs
moved 39-47 GB/s against 55.2 GB/s measured (docs/bench/vllm-gpu.json, docs/bench/topic-shift-h200.json)."""
SSD_LAYER_MS = 0.875
"""Per MoE layer and token, ms a step over a partial RAM tier spends beyond its SSD bytes at the disk's rate
(waiting on the host's read service): both 40-layer 32 VRAM / 128 RAM runs on the H200 spent about 35 ms per
token more than their SSD bytes at 1.55 GB/s (standard 69.4 ms with 0.043 GB, topic-shift 112.6 ms with 0.102 GB).
Run 29 (vLLM 0.33, standard) spent 22-39 ms beyond its bytes, with either SSD reader: the wait is one read at a time
(2.5-3.5 ms each), not the GIL."""
EXPAND_GBPS = 1.4
"""Raw GB/s one CPU thread expands compressed records at where the probe did not measure it (codec/host_decode.c on
the dev VM's 2-core EPYC, 1.28-1.44 over laws, shapes and geometries: docs/bench/codec-cpu-decode.md)."""
EXPAND_THREADS = 4
"""Reader threads expanding records at once: the SSD tier's I/O workers (BIGMOE_IO_WORKERS' default), on a machine
of at least that many cores (`expand_threads`)."""
HIT_CURVES = {
    "standard": (
        (0.5, 0.2847),
        (1, 0.5304),
        (2, 0.7324),
        (4, 0.831),
        (8, 0.8946),
        (12.75, 0.9282),
        (19, 0.9537),
        (25.5, 0.9695),
    ),
    "topic-shift": (
        (0.5, 0.2753),
        (1, 0.5419),
        (2, 0.6523),
        (4, 0.7233),
        (8, 0.8),
        (12.75, 0.8524),
        (19, 0.899),
        (25.5, 0.9409),
    ),
}
"""VRAM hit rate of the default eviction (lfu-duel) against slots / top-k, per routing family: measured by
scripts/sim_eviction.py with the pager's SlotTable on 256 experts, top-8 (docs/bench/eviction.json,
curves_256x8). At slots = experts every lookup hits."""
HIT_FAMILIES = ("standard", "topic-shift")
"""The (optimistic, pessimistic) families of the estimate."""


@dataclass(frozen=True)
class Speeds:
    """The rates one estimate uses."""

    pcie_gbps: float
    """Host-to-device copy rate, GB/s (on a CPU run: RAM-tier-to-slot copy rate)."""
    disk_gbps: float
    """SSD-tier read rate, GB/s."""
    memory_gbps: float
    """Device memory bandwidth reached by a decode step, GB/s."""
    measured: tuple[str, ...]
    """Which of the numbers were measured on this machine, one line each."""
    assumptions: tuple[str, ...]
    """Which of the numbers are assumptions, one line each."""
    expand_gbps: float = EXPAND_GBPS
    """Raw GB/s one CPU thread expands compressed SSD records at."""
    expand_threads: int = EXPAND_THREADS
    """Reader threads expanding at once (`expand_threads`)."""


@dataclass(frozen=True)
class Estimate:
    """Expected decode speed of a plan."""

    tpot_ms: tuple[float, float]
    """(optimistic, pessimistic) time per output token, ms."""
    vram_hit: tuple[float, float]
    """(optimistic, pessimistic) share of expert lookups found in VRAM."""
    ram_hit: tuple[float, float]
    """(optimistic, pessimistic) share found in VRAM or RAM (the rest is read from SSD)."""
    pcie_mib_per_token: tuple[float, float]
    """(optimistic, pessimistic) MiB copied host-to-device per token."""
    ssd_mib_per_token: tuple[float, float]
    """(optimistic, pessimistic) MiB read from the SSD tier per token."""


def gpu_spec(name: str) -> tuple[int, float] | None:
    """(VRAM GiB, bandwidth GB/s) of a known GPU whose name contains a KNOWN_GPUS key."""
    for fragment, spec in KNOWN_GPUS.items():
        if fragment.lower() in name.lower():
            return spec
    return None


def speeds_for(
    gpu: Gpu | None,
    disk: Disk | None,
    compressed: bool = False,
    expand: float | Unknown = NOT_MEASURED,
    cores: int | Unknown | None = None,
) -> Speeds:
    """The rates for an estimate: measured ones where the probe has them, assumed ones otherwise (compressed: the
    SSD tier's records are expanded on the CPU at `expand` GB/s a thread, the probe's, named too, by
    `expand_threads(cores)` threads at once)."""
    measured: list[str] = []
    notes: list[str] = []
    if gpu is None:
        pcie, memory = CPU_GBPS / 2, CPU_GBPS
        notes.append(
            f"CPU memory bandwidth {CPU_GBPS:g} GB/s per decode step (assumed); copies into expert "
            "slots run at half of it (read and write)"
        )
    else:
        pcie = _pcie(gpu, measured, notes)
        spec = gpu_spec(gpu.name) if isinstance(gpu.name, str) else None
        bandwidth = spec[1] if spec else ASSUMED_GPU_GBPS
        if spec is None:
            notes.append(f"GPU memory bandwidth {ASSUMED_GPU_GBPS:g} GB/s (assumed: {gpu.name} is not in the table)")
        memory = bandwidth * DECODE_EFFICIENCY
        notes.append(
            f"decode reaches {DECODE_EFFICIENCY:.0%} of {bandwidth:g} GB/s GPU memory bandwidth (assumed share)"
        )
    disk_gbps = _disk(disk, measured, notes)
    expand_gbps, expand_measured = expand_rate(expand)
    threads = expand_threads(cores)
    if compressed:
        (measured if expand_measured else notes).append(
            f"compressed SSD records are expanded at {expand_gbps:g} GB/s a thread by {threads} reader "
            + ("threads (measured)" if expand_measured else "threads (assumed: the dev VM's rate)")
        )
    notes.append(
        f"tier hit rates of lfu-duel eviction on the {HIT_FAMILIES[0]} (optimistic) and {HIT_FAMILIES[1]} "
        "(pessimistic) routing families, replayed by scripts/sim_eviction.py (real routing may differ)"
    )
    return Speeds(pcie, disk_gbps, memory, tuple(measured), tuple(notes), expand_gbps, threads)


def _pcie(gpu: Gpu, measured: list[str], notes: list[str]) -> float:
    if isinstance(gpu.h2d_gbps, float) and gpu.h2d_gbps > 0:
        measured.append(f"pinned host-to-device copies reach {gpu.h2d_gbps:.1f} GB/s (measured: {gpu.h2d_basis})")
        return gpu.h2d_gbps
    gen, width = gpu.pcie_gen, gpu.pcie_width
    if not isinstance(gen, int) or not isinstance(width, int) or gen not in PCIE_GBPS_PER_LANE:
        gen, width = ASSUMED_PCIE
        notes.append(f"PCIe Gen{gen} x{width} (assumed: the GPU's link was not probed)")
    pcie = PCIE_GBPS_PER_LANE[gen] * width * PCIE_EFFICIENCY
    notes.append(
        f"pinned host-to-device copies reach {PCIE_EFFICIENCY:.0%} of PCIe Gen{gen} x{width}: {pcie:.1f} GB/s "
        f"(assumed share; not measured: {gpu.h2d_gbps.reason if isinstance(gpu.h2d_gbps, Unknown) else gpu.h2d_gbps})"
    )
    return pcie


def disk_read_gbps(disk: Disk | None) -> tuple[float, bool]:
    """The SSD tier's read rate from `disk` in GB/s, and whether the probe measured it (else: assumed by kind)."""
    if disk is not None and isinstance(disk.read_gbps, float) and disk.read_gbps > 0:
        return disk.read_gbps, True
    kind = disk.kind if disk is not None else None
    return (DISK_GBPS.get(kind, UNKNOWN_DISK_GBPS) if isinstance(kind, str) else UNKNOWN_DISK_GBPS), False


def expand_rate(measured: float | Unknown) -> tuple[float, bool]:
    """The rate one CPU thread expands compressed records at, GB/s: the probe's, else EXPAND_GBPS; and which."""
    if isinstance(measured, float) and measured > 0:
        return measured, True
    return EXPAND_GBPS, False


def expand_threads(cores: int | Unknown | None) -> int:
    """Reader threads that expand records at once: EXPAND_THREADS, at most one a core where the core count is known
    (threads beyond the cores take turns; docs/benchmarks.md, run 30)."""
    return min(EXPAND_THREADS, cores) if isinstance(cores, int) and cores > 0 else EXPAND_THREADS


def ssd_ms_per_gb(
    disk_gbps: float, ratio: float | None = None, expand_gbps: float = EXPAND_GBPS, threads: int = EXPAND_THREADS
) -> float:
    """ms the SSD tier spends per GB of raw expert records it delivers from a disk reading disk_gbps; with `ratio`
    (compressed records) it reads that share of the bytes and expands every record, each after its read in the thread
    that read it (expand_gbps a thread, `threads` at once): the estimate's model."""
    if ratio is None:
        return MS_PER_S / disk_gbps
    return ratio * MS_PER_S / disk_gbps + expand_ms_per_gb(expand_gbps, threads)


def expand_ms_per_gb(expand_gbps: float, threads: int) -> float:
    """ms the reader threads spend expanding a GB of raw records, `threads` at once at expand_gbps each."""
    return MS_PER_S / (expand_gbps * threads)


def _disk(disk: Disk | None, measured: list[str], notes: list[str]) -> float:
    gbps, was_measured = disk_read_gbps(disk)
    if was_measured:
        measured.append(f"SSD tier reads at {gbps:.2f} GB/s (measured on {disk.path}: {disk.read_basis})")
        return gbps
    kind = disk.kind if disk is not None else Unknown("the model's disk was not probed")
    why = (
        "the disk was not probed"
        if disk is None
        else disk.read_gbps.reason
        if isinstance(disk.read_gbps, Unknown)
        else f"measured {disk.read_gbps}"
    )
    notes.append(
        f"SSD tier reads at {gbps:g} GB/s for a {kind if isinstance(kind, str) else 'disk of unknown kind'} "
        f"(assumed; not measured: {why})"
    )
    return gbps


def estimate(
    speeds: Speeds,
    device: str,
    *,
    layers: int,
    experts: int,
    top_k: int,
    resident_bytes: int,
    record_bytes: int,
    ssd_record_bytes: int,
    vram_slots: int,
    ram_slots: int,
    eager: bool = False,
    compressed: bool = False,
    hits: tuple[tuple[float, float], tuple[float, float]] | None = None,
) -> Estimate:
    """Expected TPOT (module docstring's model), optimistic and pessimistic.

    `resident_bytes` are the weights one token reads when every expert is resident; `record_bytes`
    one expert as RAM holds it and PCIe moves it (raw); `ssd_record_bytes` as the SSD tier holds it.
    `eager`: a CUDA run without graphs (EAGER_LAYER_MS per layer instead of GRAPH_LAYER_MS).
    `compressed`: the SSD tier's records are compressed; each read one is expanded on the CPU (speeds.expand_gbps a
    thread, speeds.expand_threads at once), after its read in the same thread.
    `hits`: ((vram, vram-or-ram) optimistic, (vram, vram-or-ram) pessimistic) to use instead of
    HIT_CURVES (a measured run's own hit rates).
    """
    base_ms = resident_bytes / (speeds.memory_gbps * GB) * MS_PER_S + STEP_OVERHEAD_MS[device]
    if device == "cuda":
        base_ms += (EAGER_LAYER_MS if eager else GRAPH_LAYER_MS) * layers
    lookups = layers * top_k
    if hits is None:
        hits = tuple(
            (family_hit(f, vram_slots, experts, top_k), family_hit(f, ram_slots, experts, top_k)) for f in HIT_FAMILIES
        )
    results = []
    for vram_hit, ram_hit in hits:
        ram_hit = max(vram_hit, ram_hit)
        pcie_bytes = lookups * (1 - vram_hit) * record_bytes
        ssd_bytes = lookups * (1 - ram_hit) * ssd_record_bytes
        pcie_ms = pcie_bytes / (speeds.pcie_gbps * PAGED_COPY_SHARE * GB) * MS_PER_S
        ssd_ms = ssd_bytes / (speeds.disk_gbps * GB) * MS_PER_S + (
            SSD_LAYER_MS * layers if ram_slots < experts else 0.0
        )
        if compressed:
            expanded_gb = lookups * (1 - ram_hit) * record_bytes / GB
            ssd_ms += expanded_gb * expand_ms_per_gb(speeds.expand_gbps, speeds.expand_threads)
        results.append((vram_hit, ram_hit, pcie_bytes, ssd_bytes, base_ms + pcie_ms + ssd_ms))
    (v0, r0, p0, s0, t0), (v1, r1, p1, s1, t1) = results
    mib = float(1 << 20)
    return Estimate(
        tpot_ms=(round(min(t0, t1), 2), round(max(t0, t1), 2)),
        vram_hit=(round(v0, 3), round(v1, 3)),
        ram_hit=(round(r0, 3), round(r1, 3)),
        pcie_mib_per_token=(round(p0 / mib, 1), round(p1 / mib, 1)),
        ssd_mib_per_token=(round(s0 / mib, 1), round(s1 / mib, 1)),
    )


def family_hit(family: str, slots: int, experts: int, top_k: int) -> float:
    """Hit rate of a tier of `slots` per layer under a family: HIT_CURVES at slots / top_k, linear between
    points, 1.0 at slots = experts (the curve's last point joined to it), 0 at no slot."""
    if slots >= experts:
        return 1.0
    x = max(slots, 0) / top_k
    points = ((0.0, 0.0), *HIT_CURVES[family], (experts / top_k, 1.0))
    points = tuple(p for p in points if p[0] <= experts / top_k)
    for (x0, y0), (x1, y1) in zip(points, points[1:]):
        if x <= x1:
            return y0 + (y1 - y0) * (x - x0) / (x1 - x0) if x1 > x0 else y1
    return 1.0
