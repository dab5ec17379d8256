"""The bench's configuration-name language: a name such as `bigmoe-102-layerbuf@r0.8~lru+one-node+b1#2` is a base
configuration (BASES), then `@r[RECALL]` (replayed predictions), `~POLICY` (eviction), `+...` suffixes (each an engine
setting) and a last `#N` (another engine of the same configuration). Here: the suffixes and what each sets, the
parsers, the result rows' names and the plugin defaults a name or a row's env spells. Apart from
scripts/gpu_vllm_bench.py (which runs engines of these names) so that scripts/bench_combine.py, which reads result
rows by name, needs no engine harness.
"""

from __future__ import annotations

from typing import NamedTuple

import traces  # noqa: E402  (scripts/ is not a package)
from bigmoe_pager.core.slots import MIN_USED_PERCENT, PREFETCH_BUDGET
from bigmoe_pager.settings import EVICTION_CHOICES, PagerSettings

AHEAD = "+ahead"
"""Name suffix: the predictions also post SSD reads ahead of need (BIGMOE_SSD_READ_AHEAD=1); needs @rRECALL."""
AHEAD_DEEP = "+ahead4"
"""Name suffix: +ahead four layers deep (BIGMOE_SSD_READ_AHEAD_LAYERS=4); needs @rRECALL."""
HIGH = "+hi"
"""Name suffix: the prefetch side stream at high priority (BIGMOE_PREFETCH_HIGH_PRIORITY=1); needs @rRECALL."""
CHAINED_ONLY = "+chained-only"
"""Name suffix: forwards that are not chained (prefill) propose and prefetch nothing, so no side stream is used
outside the decode graph (BIGMOE_PREFETCH_CHAINED_ONLY=1; with the chain on, also the default since run 27);
needs @rRECALL."""
EVERY_FORWARD = "+every-forward"
"""Name suffix: every forward proposes and prefetches, prefill's too (BIGMOE_PREFETCH_CHAINED_ONLY=0: the default
with the chain on until run 27)."""
CHAIN = "+chain"
"""Name suffix: the rounds of a forward captured whole on one side-stream branch, forked once, each waiting for its
layer's step on the device (BIGMOE_PREFETCH_CHAIN=1); needs @rRECALL."""
JOINLESS = "+joinless"
"""Name suffix: chained rounds with no join before each step, which settles its round and waits only for the copies
it needs on the device (BIGMOE_PREFETCH_JOINLESS=1, core.round_sync); needs @rRECALL."""
ONE_NODE = "+one-node"
"""Name suffix: a joinless forward's replayed rounds as one kernel a forward, forked once (BIGMOE_PREFETCH_ONE_NODE=1,
core.forward_rounds); needs @rRECALL."""
HOST_COPIER = "+host"
"""Name suffix: a joinless forward's rounds copied by a host thread through the copy engines, each publishing its list
(BIGMOE_PREFETCH_HOST_COPIER=1, core.host_copier; with +one-node, the one-node kernel's one program decides and
publishes); needs @rRECALL. Run 19's `+host` rows decided each round in line instead (removed since: slower)."""
C_READER = "+creader"
"""Name suffix, with or without @rRECALL: the SSD tier's requests are answered by the native reader's C threads
instead of the service's Python threads (BIGMOE_SSD_READER=native); meaningful with an SSD tier. Run 29 measured it
as `bigmoe-32-ram128-ssd-layerbuf` against `+pyreader`, when native was the default."""
ENGINE_SUFFIXES = {
    C_READER: {"BIGMOE_SSD_READER": "native"},
}
"""Suffixes that change how the pager pages, not how it prefetches: a name may carry them without @rRECALL."""
SETTING_SUFFIXES = {
    "+gate": "BIGMOE_PREFETCH_MIN_USED_PERCENT",
    "+b": "BIGMOE_PREFETCH_BUDGET",
    "+nodes": "BIGMOE_PREFETCH_ONE_NODE_PROGRAMS",
    "+dist": "BIGMOE_PREFETCH_DISTANCE",
    "+hot": "BIGMOE_HOST_COPIER_HOT_MS",
    "+switch": "BIGMOE_GIL_SWITCH_US",
}
"""Name suffixes that carry a number, and the setting it sets (need @rRECALL but `+switchN`, the vLLM process's GIL
switch interval in us, which any bigmoe engine may carry): `+gateN` the VRAM prefetch gate at N%
(0: none), `+bN` a prefetch budget of N experts a layer's round (0: none), `+nodesN` the one-node kernel's
programs (with +one-node), `+distN` a joinless forward's rounds N layers ahead (the replayed rows for layer l+N are
as right as the next layer's, which a real predictor's are not), `+hotN` the host copier's thread busy-polling N ms
after its last round (0: it naps at once)."""
PREDICTION_SUFFIXES = {
    AHEAD: {"BIGMOE_SSD_READ_AHEAD": "1"},
    AHEAD_DEEP: {"BIGMOE_SSD_READ_AHEAD": "1", "BIGMOE_SSD_READ_AHEAD_LAYERS": "4"},
    HIGH: {"BIGMOE_PREFETCH_HIGH_PRIORITY": "1"},
    CHAINED_ONLY: {"BIGMOE_PREFETCH_CHAINED_ONLY": "1"},
    EVERY_FORWARD: {"BIGMOE_PREFETCH_CHAINED_ONLY": "0"},
    CHAIN: {"BIGMOE_PREFETCH_CHAIN": "1"},
    JOINLESS: {"BIGMOE_PREFETCH_CHAIN": "1", "BIGMOE_PREFETCH_JOINLESS": "1"},
    ONE_NODE: {"BIGMOE_PREFETCH_ONE_NODE": "1"},
    HOST_COPIER: {"BIGMOE_PREFETCH_HOST_COPIER": "1"},
    **ENGINE_SUFFIXES,
}
"""The last suffixes a name with @r may carry, in any order, and what each sets (besides SETTING_SUFFIXES)."""
EVERY = "every"
"""parse_name's recall of a bare `@r`: the configuration is measured at every recall of --recalls."""
RECALLS = (0.0, 0.6, 0.8, 0.95, 1.0)
"""--recalls' default: issue 15's TPOT-against-recall points."""
BASES = (
    "resident",
    "offload17",
    "bigmoe-102",
    "bigmoe-32",
    "bigmoe-32-ram128-ssd",
    "bigmoe-102-layerbuf",
    "bigmoe-32-layerbuf",
    "bigmoe-32-ram128-ssd-layerbuf",
)
"""The base configurations a name starts with, in gpu_vllm_bench.configs' order (which says what each runs)."""
EVICTIONS = EVICTION_CHOICES
"""What `~POLICY` may name: the engine setting BIGMOE_EVICTION's words."""


def untagged(name: str) -> tuple[str, str]:
    """('bigmoe-102@r', '#2') for 'bigmoe-102@r#2': a name and its last `#N` (another engine of the same
    configuration), or '' without one."""
    stem, mark, number = name.rpartition("#")
    return (stem, mark + number) if mark and number.isdigit() else (name, "")


def parse_name(name: str) -> tuple[str, float | str | None, str | None]:
    """'bigmoe-102@r0.8~lru' -> ('bigmoe-102', 0.8, 'lru'); a bare '@r' gives EVERY (trailing +ahead / +hi and a
    last #N are checked, not returned); KeyError for an unknown base or policy, ValueError for a recall outside
    [0, 1] or a +ahead / +hi without @r."""
    stem, suffixes = split_suffixes(untagged(name)[0])
    base, _, policy = stem.partition("~")
    base, at, recall = base.partition("@r")
    if base not in BASES or (policy and policy not in EVICTIONS):
        raise KeyError(name)
    value = (float(recall) if recall else EVERY) if at else None
    prefetching = [s for s in suffixes if s not in ENGINE_SUFFIXES and not s.startswith("+switch")]
    if (isinstance(value, float) and not 0.0 <= value <= 1.0) or (prefetching and value is None):
        raise ValueError(name)
    if any(int(s.removeprefix("+gate")) > 100 for s in suffixes if s.startswith("+gate")):
        raise ValueError(name)
    return base, value, policy or None


def split_suffixes(name: str) -> tuple[str, list[str]]:
    """('bigmoe-102@r0.8', ['+hi', '+b1']) for 'bigmoe-102@r0.8+b1+hi': the trailing PREDICTION_SUFFIXES and
    SETTING_SUFFIXES (each with its number)."""
    found: list[str] = []
    while suffix := _last_suffix(name):
        name = name.removesuffix(suffix)
        found.append(suffix)
    return name, found


def _last_suffix(name: str) -> str | None:
    fixed = next((s for s in PREDICTION_SUFFIXES if name.endswith(s)), None)
    if fixed:
        return fixed
    stem = name.rstrip("0123456789")
    number = name[len(stem) :]
    prefix = next((p for p in SETTING_SUFFIXES if stem.endswith(p)), None)
    return prefix + number if prefix and number else None


def suffix_env(suffix: str) -> dict[str, str]:
    """What one suffix of split_suffixes sets: '+gate25' -> {'BIGMOE_PREFETCH_MIN_USED_PERCENT': '25'}."""
    if suffix in PREDICTION_SUFFIXES:
        return PREDICTION_SUFFIXES[suffix]
    prefix = next(p for p in SETTING_SUFFIXES if suffix.startswith(p) and suffix[len(p) :].isdigit())
    return {SETTING_SUFFIXES[prefix]: str(int(suffix[len(prefix) :]))}


class Point(NamedTuple):
    """Where a prediction trace sits: its recall, and how its wrong ids are drawn (traces.WRONG_MODELS)."""

    recall: float
    wrong: str = "uniform"


def parse_points(text: str, wrong: str) -> list[Point]:
    """'0,0:none,0.8' -> the points a bare @r measures; an item without ':WRONG' takes `wrong`. ValueError if bad."""
    points = []
    for item in text.split(","):
        value, _, model = item.partition(":")
        point = Point(float(value), model or wrong)
        if not 0.0 <= point.recall <= 1.0 or point.wrong not in traces.WRONG_MODELS:
            raise ValueError(item)
        points.append(point)
    return points


def recalls_of(name: str, points: list[Point], wrong: str = "uniform") -> list[Point | None]:
    """The prediction points one engine of this configuration measures (None: no predictions, no prefetch): a bare
    @r every one of --recalls, @rX the point (X, wrong)."""
    recall = parse_name(name)[1]
    if recall is None:
        return [None]
    return list(points) if recall == EVERY else [Point(recall, wrong)]


def row_name(name: str, point: Point | None, wrong: str = "uniform") -> str:
    """A result row's name: the configuration's with its recall written out ('bigmoe-102@r' at 0.8: '...@r0.8'), and
    ':WRONG' after it where the point's wrong ids are not the run's --wrong ('...@r0.8:popular')."""
    if point is None:
        return name
    name, copy = untagged(name)
    base, _, rest = name.partition("@r")
    suffix = rest[len(rest) - len(rest.lstrip("0123456789.")) :]  # ~POLICY and +ahead after the number
    tag = "" if point.wrong == wrong else f":{point.wrong}"
    return f"{base}@r{point.recall:g}{tag}{suffix}{copy}"


def prefetch_defaults() -> dict[str, str]:
    """The plugin's default prefetch gate and budget, as the settings an engine's env would name them."""
    settings = PagerSettings()
    gate, budget = settings.prefetch_min_used_percent, settings.prefetch_budget
    return {
        "BIGMOE_PREFETCH_MIN_USED_PERCENT": str(MIN_USED_PERCENT if gate is None else gate),
        "BIGMOE_PREFETCH_BUDGET": str(PREFETCH_BUDGET if budget is None else budget),
    }


def ran_current_defaults(row: dict, prefetch: bool) -> bool:
    """Whether a row's engine named the plugin's current default eviction (and, for a prefetching row, its default
    gate and budget) in its env. Engines name them since runs 12 and 13; older rows ran the defaults of their day."""
    env = row.get("env") or {}
    wanted = {"BIGMOE_EVICTION": PagerSettings().eviction, **(prefetch_defaults() if prefetch else {})}
    return all(env.get(key) == value for key, value in wanted.items())


def default_prefetch_suffix() -> str:
    """The name suffixes that spell the plugin's default gate and budget ('+b1+gate25')."""
    env = prefetch_defaults()
    return f"+b{env['BIGMOE_PREFETCH_BUDGET']}+gate{env['BIGMOE_PREFETCH_MIN_USED_PERCENT']}"
