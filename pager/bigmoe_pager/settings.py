"""The one contract between the app and the plugins: `BIGMOE_*` settings.

The app writes these variables (or a TOML file that `BIGMOE_SETTINGS` points
to); every vLLM process the plugins load in reads them with `PagerSettings.from_env()`.
A variable beats the same key in the file. Bad values raise `SettingsError` with
one line that names the variable and what it accepts.
"""

from __future__ import annotations

import dataclasses
import difflib
import os
import tomllib
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping

COMPRESS_CHOICES = ("on", "off", "auto")
EVICTION_CHOICES = ("lfu", "lru", "lfu-fast", "lfu-duel")
PREDICT_CHOICES = ("off", "router")
SSD_READER_CHOICES = ("native", "python")
# settings that take one of a few words
_CHOICES = {
    "compress": COMPRESS_CHOICES,
    "eviction": EVICTION_CHOICES,
    "predict": PREDICT_CHOICES,
    "ssd_reader": SSD_READER_CHOICES,
}


class SettingsError(ValueError):
    """A setting has a value the pager cannot use; the message is one line."""


@dataclass(frozen=True)
class PagerSettings:
    """What the expert and n-gram pagers do in a vLLM process."""

    enabled: bool = False
    """BIGMOE_PAGER: 1 pages MoE experts across VRAM, RAM and SSD; 0 leaves vLLM alone."""
    vram_slots: tuple[int, ...] = ()
    """BIGMOE_VRAM_SLOTS: VRAM expert slots per MoE layer: one integer or one per layer (comma list); empty = all."""
    ram_slots: tuple[int, ...] = ()
    """BIGMOE_RAM_SLOTS: pinned host-RAM slots per MoE layer, like vram_slots; empty = every expert (no SSD tier)."""
    paging_file: Path | None = None
    """BIGMOE_PAGING_FILE: paging file the SSD tier reads; unset = read the checkpoint's safetensors in place."""
    compress: str = "auto"
    """BIGMOE_COMPRESS: on / off / auto (= on with a paging file): lossless FP8 codec for paging-file records;
    each is expanded as it enters RAM."""
    io_workers: int = 4
    """BIGMOE_IO_WORKERS: host threads reading experts from SSD."""
    read_timeout_s: float = 10.0
    """BIGMOE_READ_TIMEOUT_S: seconds one SSD read may take before it is retried."""
    read_retries: int = 2
    """BIGMOE_READ_RETRIES: retries of a failed or late SSD read before the step fails with an error."""
    ssd_reader: str = "python"
    """BIGMOE_SSD_READER: python / native: who answers the GPU's SSD requests: Python threads (each read crosses the
    GIL several times) or C threads (core/ssd_reader.c, no GIL on the read path; where they cannot start, no C
    compiler or a store they cannot plan, the Python threads serve and the log says why). Python stays the default:
    inside vLLM on the H200 (run 29) the C threads were level in TPOT (within the order two engines ran in) and
    2.6 s slower in TTFT in both orders; beside a GIL-busy Python thread they answer a read 3x sooner. Outside vLLM,
    at prefill's size (100 experts a request, run 30), they were level or faster, so that TTFT gap is not their own
    speed; the default waits for both orders inside vLLM again."""
    cuda_graphs: bool = True
    """BIGMOE_CUDA_GRAPHS: 1 = on CUDA the GPU decides and copies, so vLLM may replay decode in CUDA graphs (with
    --max-cudagraph-capture-size <= VRAM slots / top-k); 0 = host-driven (--enforce-eager). Either reads a
    compressed paging file."""
    eviction: str = "lfu-duel"
    """BIGMOE_EVICTION: lfu-duel / lfu-fast / lfu / lru: which unneeded expert a full tier of the device-driven pager
    evicts: lfu-duel keeps counts halved every 16 and every 256 steps and ranks by the one whose shadow table hits
    more, or by recency alone while an lru shadow hits more than that one (set dueling); lfu-fast / lfu: fewest
    recent uses (counts halved every 16 / 256 steps); lru: least recently used; host-driven: lru. lfu-duel follows
    the best of lfu, lfu-fast and lru in simulation on four routing families (docs/bench/eviction-duel3.json) and on
    80 drawn ones it was not chosen on (docs/bench/eviction-holdout*.json: never below lru by more than 0.002 of
    VRAM hit); its two-shadow form (session 13 to 53) was measured in vLLM on the H200 (run 10: 7.17 against
    lfu-fast's 7.79 ms at 32 slots, standard; where both hit the same, topic-shift, 0.18 ms slower in run 10 and
    0.12 ms in run 11, once its shadow play ran beside the step's copy)."""
    prefill_buffer: bool = True
    """BIGMOE_PREFILL_BUFFER: 1 = on CUDA, a step too big for the VRAM slots (prefill) runs in one call over a VRAM
    buffer of one layer's experts (E x expert bytes, shared by all layers; 7x lower TTFT on the H200, same tokens);
    0 = in token ranges through the slots. The device-driven pager only."""
    ssd_read_ahead: bool = False
    """BIGMOE_SSD_READ_AHEAD: 1 = the device-driven pager's expert predictions also post SSD->RAM reads early (no
    GPU wait until a step needs one). Off: right guesses four layers ahead paid (run 57: 20-24% less TPOT on 8 and 12
    layers) and the gate of 50 held wrong ones level (+0-2% at recall 0.8), but only on one routing family with
    replayed proposals; the live ones (BIGMOE_PREDICT) are not yet scored on real weights."""
    ssd_read_ahead_layers: int = 1
    """BIGMOE_SSD_READ_AHEAD_LAYERS: with BIGMOE_SSD_READ_AHEAD=1, how many layers ahead each MoE layer posts the
    SSD reads of predicted experts (1: the next layer only; 0 counts as 1). Deeper gives the disk more time and
    more reads in flight, from proposals that are less often right (a layer's router on an earlier hidden state);
    with replayed proposals as right at every depth, 4 beat 1 (runs 56, 57). Each depth's reads have their own gate
    (one for all shut the next layer's good reads with the deeper ones' bad, in simulation). 1 stays: with proposals
    0.1-0.15 less right a layer further ahead, depth 4 read 4-62% more than depth 1 in simulation, untimed on a GPU.
    A read a step waits for goes before the deeper reads queued ahead of it (hurry words, since session 69).
    With BIGMOE_TRACE_PATH and BIGMOE_PREDICT=router it is also the depth a recorded trace's live proposals reach
    (predicted_ids_ahead), reads ahead on or off."""
    predict: str = "off"
    """BIGMOE_PREDICT: off / router: router = layer l+1's router applied to what layer l's experts receive proposes
    l+1's experts, which the device-driven pager prefetches on a side stream; off until measured on real weights."""
    predict_top: int = 0
    """BIGMOE_PREDICT_TOP: experts the router predictor proposes per token; 0 = the model's top-k. A wider proposal is
    right more often but less of it is used: twice the top-k on the tiny model (precision 0.47) shut the SSD reads'
    gate of 50 at every depth (benchmarks.md, session 68)."""
    prefetch_high_priority: bool = False
    """BIGMOE_PREFETCH_HIGH_PRIORITY: 1 = the prefetch side stream runs at the GPU's high stream priority, so its
    copies get SMs ahead of vLLM's kernels; 0 = normal priority (the default until measured inside vLLM)."""
    prefetch_chain: bool = False
    """BIGMOE_PREFETCH_CHAIN: 1 = in a forward captured whole (vLLM's FULL graphs) over full RAM tiers, the side
    stream is forked once and each later round waits for its layer's step on the device (core.prefetch_chain)
    instead of a graph fork a layer; 0 = a fork a round. Off: inside vLLM 0.33 it ran 0.10 ms a token slower at recall
    0 (run 16: its joins a layer cost what the forks did)."""
    prefetch_joinless: bool = False
    """BIGMOE_PREFETCH_JOINLESS: 1 = a chained forward (as BIGMOE_PREFETCH_CHAIN=1, which this implies) joins its
    side stream only at its end: each step settles the round into its table on the device and waits only for the
    copies it needs (core.round_sync); 0 = a join before each step. Off: inside vLLM 0.33 it saved nothing (run 17:
    0.09 ms a token slower than forks at recall 0; with no edge a layer the side branch's nodes still cost 0.43)."""
    prefetch_one_node: bool = False
    """BIGMOE_PREFETCH_ONE_NODE: 1 = a joinless chained forward (as BIGMOE_PREFETCH_JOINLESS=1, which this implies)
    with a replayed trace's proposals runs its rounds as one kernel forked once (core.forward_rounds: one side node a
    forward instead of three a layer); layers that cannot share it (partial RAM tiers) keep per-layer rounds. The
    live predictor's rounds stay per layer. Off: inside vLLM 0.33 it cost 0.59 ms a token at recall 0 where forks
    cost 0.43 (run 18: a kernel held for the whole forward takes SMs from vLLM's)."""
    prefetch_one_node_programs: int = 0
    """BIGMOE_PREFETCH_ONE_NODE_PROGRAMS: programs (CTAs) of the one-node kernel, held for the whole forward; fewer
    hold fewer SMs and copy slower (0: the pagers' prefetch programs, 16)."""
    prefetch_chained_only: bool | None = None
    """BIGMOE_PREFETCH_CHAINED_ONLY: 1 = forwards that are not chained (vLLM's eager and piecewise ones: prefill and
    the sizes no full graph holds) propose and prefetch nothing; their steps page on demand; 0 = every forward
    prefetches; unset = 1's rule where the chain is on (BIGMOE_PREFETCH_CHAIN or a setting that implies it), except
    that forwards captured whole still prefetch when they cannot be chained; every forward otherwise. Run 27: with the
    joinless path, side streams in prefill's forwards slowed every launch of the decode graph (0.10 -> 0.42 us a gap,
    0.30 ms a token at recall 0); without them recall 0 costs about 0.1 ms a token, the joinless steps' handoff (run
    34)."""
    prefetch_host_copier: bool = False
    """BIGMOE_PREFETCH_HOST_COPIER: 1 = a joinless chained forward (as BIGMOE_PREFETCH_JOINLESS=1, which this implies)
    whose rounds over full RAM tiers publish their decided lists to a host thread (core.host_copier) that copies them
    with the GPU's copy engines: no SM spent on copies. Each layer's round publishes after its admit; with
    BIGMOE_PREFETCH_ONE_NODE=1 too, the one-node kernel (one program, forked once a forward) decides the replayed
    rounds and publishes them. Off: level with forks at recall 0 inside vLLM 0.33, 0.07-0.21 ms faster at 0.8 (run
    19, the one-node placement)."""
    host_copier_hot_ms: int | None = None
    """BIGMOE_HOST_COPIER_HOT_MS: how long (ms) the host copier's thread busy-polls its mailboxes after its last
    round before it naps (20 us naps, 1 ms after a second idle); 0 = it naps at once, each round waiting up to a nap
    before it is copied; unset: core.host_copier.HOT_MS. A benchmark knob: what the spinning thread costs the engine
    beside it; run 25: 0 was 0.08 ms a token faster at recall 0 and 0.32-0.59 slower at 0.8, so the default stays."""
    gil_switch_us: int = 0
    """BIGMOE_GIL_SWITCH_US: a benchmark knob: the GIL switch interval (us) of the vLLM process the pager runs in
    (sys.setswitchinterval; 0 = Python's own, 5000). With BIGMOE_SSD_READER=python the SSD tier's reads are answered
    by Python threads that need the GIL while vLLM's host thread runs on during decode, each waiting up to one
    interval; the native reader's C threads need no GIL. Whether that wait is the 0.875 ms a layer the plan charges an
    SSD tier (app/bigmoe/plan/speed.SSD_LAYER_MS) is what gpu_vllm_bench's `+switchN` and `+creader` measure."""
    prefetch_distance: int = 1
    """BIGMOE_PREFETCH_DISTANCE: D > 1 = in a joinless chained forward (as BIGMOE_PREFETCH_JOINLESS=1, which this
    implies), layer l's round prefetches into layer l+D (its router on layer l's hidden state, or a replayed trace's
    rows for it), so its copies have D layers of compute to land in; the model's first layer also fills layers 1 ..
    D-1 (the one-node kernel likewise decides layer l's round once layer l-D's step is done). 0 or 1 = the next layer;
    forwards that are not joinless keep the next layer. Inside vLLM 0.33 (run 20), distance 2 changed nothing
    measurable at the default budget of 1."""
    prefetch_min_used_percent: int | None = None
    """BIGMOE_PREFETCH_MIN_USED_PERCENT: 0-100, the VRAM prefetch gate's threshold: a layer copies predicted experts
    only while at least this percent of those it judged were used (0: always copy); unset: the pager's default,
    core.slots.MIN_USED_PERCENT (25, run 12's choice with a budget of 1; without a budget 60 was)."""
    prefetch_budget: int | None = None
    """BIGMOE_PREFETCH_BUDGET: experts one layer's VRAM prefetch round copies at most, those with the highest use
    counts first (0: no limit); unset: the pager's default, core.slots.PREFETCH_BUDGET (1, run 12)."""
    hot_profile: Path | None = None
    """BIGMOE_HOT_PROFILE: saved hot-expert profile (.npz) that warms the tiers at start."""
    trace_path: Path | None = None
    """BIGMOE_TRACE_PATH: record routing (topk_ids int32 [tokens, layers, k]) to this .npz at shutdown."""
    route_replay: Path | None = None
    """BIGMOE_ROUTE_REPLAY: benchmark only: replace the router's top-k ids with this trace's, in order."""
    ngram: bool = False
    """BIGMOE_NGRAM: 1 serves the Qwen4Exp n-gram table from the checkpoint on SSD instead of loading it."""
    ngram_cache_rows: int = 0
    """BIGMOE_NGRAM_CACHE_ROWS: rows of the n-gram RAM row cache; 0 = rely on the OS page cache."""

    # ---- reading -------------------------------------------------------------------

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> "PagerSettings":
        env = os.environ if env is None else env
        values: dict[str, str] = {}
        file = env.get("BIGMOE_SETTINGS")
        if file:
            values.update(_read_file(Path(file)))
        for f in dataclasses.fields(cls):
            var = _var(f)
            if var in env and env[var] != "":
                values[f.name] = env[var]
        return cls(**{name: _parse(cls, name, raw) for name, raw in values.items()})

    def to_env(self) -> dict[str, str]:
        """The variables that make `from_env` return these settings (defaults left out)."""
        out: dict[str, str] = {}
        default = PagerSettings()
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if value == getattr(default, f.name):
                continue
            out[_var(f)] = _format(value)
        return out

    # ---- per-layer numbers --------------------------------------------------------

    def slots_for(self, layer: int, num_layers: int, num_experts: int) -> tuple[int, int]:
        """(VRAM slots, RAM slots) for MoE layer `layer` of `num_layers`, each clamped to experts."""
        vram = _per_layer(self.vram_slots, layer, num_layers, num_experts, "BIGMOE_VRAM_SLOTS")
        ram = _per_layer(self.ram_slots, layer, num_layers, num_experts, "BIGMOE_RAM_SLOTS")
        if vram < 1:
            raise SettingsError(f"BIGMOE_VRAM_SLOTS: layer {layer} has {vram} slots; each layer needs at least 1")
        if ram < vram:
            raise SettingsError(
                f"BIGMOE_RAM_SLOTS: layer {layer} has {ram} RAM slots, fewer than its {vram} VRAM slots; "
                "RAM slots must be >= VRAM slots"
            )
        return vram, ram

    def use_codec(self) -> bool | None:
        """Whether expert records are compressed: as set; auto: not without a paging file, and None (as the paging
        file's header says: the SSD tier reads it) with one."""
        if self.compress == "auto":
            return None if self.paging_file is not None else False
        return self.compress == "on"

    @property
    def host_driven(self) -> bool:
        """On CUDA, whether the host-driven pager pages the experts (see `host_driven` below)."""
        return host_driven(self.cuda_graphs)


def host_driven(cuda_graphs: bool) -> bool:
    """The one rule for which pager runs on CUDA: the host-driven one (eager) when CUDA graphs are not wanted,
    the device-driven one (CUDA graphs) otherwise. Either reads a compressed paging file (the SSD tier's threads
    expand each record as it enters RAM: codec/record_decoder.py). The app's plan and the plugin both ask it."""
    return not cuda_graphs


def variable_names() -> tuple[str, ...]:
    """Every variable `PagerSettings.from_env` reads, BIGMOE_SETTINGS (the file) first."""
    return ("BIGMOE_SETTINGS", *(_var(f) for f in dataclasses.fields(PagerSettings)))


OTHER_VARIABLES = frozenset({"BIGMOE_HOME", "BIGMOE_API_KEY", "BIGMOE_CACHE_DIR", "BIGMOE_VENV", "BIGMOE_HEARTBEAT_S"})
"""BIGMOE_* variables that other parts read (the app, the C build cache, the installer): not pager settings."""


def unknown_variables(env: Mapping[str, str]) -> list[str]:
    """One line for each BIGMOE_* variable in `env` that nothing in bigmoe reads (a typo, or a removed setting),
    with the closest setting's name where one is close."""
    known = set(variable_names()) | OTHER_VARIABLES
    lines = []
    for name in sorted(k for k in env if k.startswith("BIGMOE_") and k not in known):
        near = difflib.get_close_matches(name, sorted(known), n=1, cutoff=0.8)
        hint = f"; did you mean {near[0]}?" if near else " (a typo, or a setting since removed?)"
        lines.append(f"{name} is not a bigmoe setting and is ignored{hint}")
    return lines


_VARIABLES = {"enabled": "BIGMOE_PAGER"}


def _var(f: dataclasses.Field) -> str:
    return _VARIABLES.get(f.name, "BIGMOE_" + f.name.upper())


def _read_file(path: Path) -> dict[str, str]:
    try:
        data = tomllib.loads(path.read_text())
    except OSError as e:
        raise SettingsError(f"BIGMOE_SETTINGS: cannot read {path}: {e.strerror}") from None
    except tomllib.TOMLDecodeError as e:
        raise SettingsError(f"BIGMOE_SETTINGS: {path} is not valid TOML: {e}") from None
    names = {f.name for f in dataclasses.fields(PagerSettings)}
    unknown = sorted(set(data) - names)
    if unknown:
        raise SettingsError(f"BIGMOE_SETTINGS: {path} has unknown keys {unknown}; known: {sorted(names)}")
    return {k: _format(v) if not isinstance(v, str) else v for k, v in data.items()}


def _format(value: object) -> str:
    if isinstance(value, bool):
        return "1" if value else "0"
    if isinstance(value, (tuple, list)):
        return ",".join(str(v) for v in value)
    return str(value)


def _parse(cls: type, name: str, raw: str) -> object:
    f = {f.name: f for f in dataclasses.fields(cls)}[name]
    var = _var(f)
    kind = f.type
    raw = raw.strip()
    try:
        if kind in ("bool", "bool | None"):  # None: unset, the pager's default
            if raw.lower() in ("1", "true", "yes", "on"):
                return True
            if raw.lower() in ("0", "false", "no", "off"):
                return False
            raise ValueError
        if kind == "tuple[int, ...]":
            items = tuple(int(x) for x in raw.split(",") if x.strip())
            if any(x < 0 for x in items):
                raise ValueError
            return items
        if kind in ("int", "int | None"):  # None: unset, the pager's default
            value = int(raw)
            if value < 0 or (name.endswith("_percent") and value > 100):
                raise ValueError
            return value
        if kind == "float":
            value = float(raw)
            if not value > 0:
                raise ValueError
            return value
        if kind == "Path | None":
            return Path(raw).expanduser()
        choices = _CHOICES.get(name)
        if choices is not None and raw not in choices:
            raise ValueError
    except ValueError:
        raise SettingsError(f"{var}={raw!r} is not valid; expected {_expected(kind, name)}") from None
    return raw


def _expected(kind: str, name: str) -> str:
    if name.endswith("_percent"):
        return "an integer from 0 to 100"
    return {
        "bool": "1 or 0",
        "bool | None": "1 or 0",
        "tuple[int, ...]": "a non-negative integer or a comma list of them, one per MoE layer",
        "int": "a non-negative integer",
        "int | None": "a non-negative integer",
        "float": "a positive number",
    }.get(kind, " / ".join(_CHOICES.get(name, ("a path",))))


def _per_layer(values: tuple[int, ...], layer: int, num_layers: int, experts: int, var: str) -> int:
    if not values:
        return experts
    if len(values) == 1:
        return min(values[0], experts)
    if len(values) != num_layers:
        raise SettingsError(
            f"{var} lists {len(values)} values but the model has {num_layers} MoE layers; "
            "give one value or one per layer"
        )
    return min(values[layer], experts)
