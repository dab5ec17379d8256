"""What a stuck GPU run can still say: the prefetch chain's words, the host copier's counters and each rounds layer's
table words, read beside the work that does not finish (scripts/gpu_overlap_probe.py's --stall-after; runs 36-37).

`rounds` is the probe's HostRounds, read through what it holds: `chain` (core.prefetch_chain), `copier`
(core.host_copier), `pagers` (one per rounds layer) and `boxes` (their mailboxes, pinned host memory).
"""

from __future__ import annotations

import time

import torch
from bigmoe_pager.core.prefetch_chain import CANCELS, FORWARD, LATE, OPEN, PUBLISHED, QUIET, RESUME, STEPPED, TIMEOUTS


class Stalled(Exception):
    """A run's queued GPU work did not finish in time; `state` is what the probe could read beside it."""

    def __init__(self, state: dict) -> None:
        super().__init__(state.get("phase", "stalled"))
        self.state = state


def finished_within(done, seconds: float, nap_s: float = 0.01) -> bool:
    """Poll `done()` until it is true (True) or `seconds` have passed (False)."""
    deadline = time.monotonic() + seconds
    while not done():
        if time.monotonic() >= deadline:
            return False
        time.sleep(nap_s)
    return True


CHAIN_WORDS = {
    "forward": FORWARD,
    "timeouts": TIMEOUTS,
    "cancels": CANCELS,
    "published": PUBLISHED,
    "quiet": QUIET,
    "open": OPEN,
    "late": LATE,
    "resume": RESUME,
}


def chain_words(flags: list[int]) -> dict:
    """The prefetch chain's words by name (core.prefetch_chain), STEPPED as one forward number a layer."""
    return {**{name: flags[i] for name, i in CHAIN_WORDS.items()}, "stepped": flags[STEPPED:]}


def stall_words(rounds, device: torch.device) -> dict:
    """The chain's words, the host copier's counters (host memory) and each rounds layer's words (layer_words), read
    beside the stuck work; {} for a run without host rounds."""
    if rounds is None:
        return {}
    flags, *layers = read_beside([rounds.chain.flags, *layer_tensors(rounds)], device)
    chain = UNREAD if flags is None else chain_words(flags.tolist())
    return {"chain": chain, "host_copier": rounds.copier.stats(), "layers": layer_words(rounds, layers)}


UNREAD = "unread: the copy waited 5 s"


def read_beside(tensors: list[torch.Tensor], device: torch.device) -> list[torch.Tensor | None]:
    """Host copies of device tensors while the current stream may be stuck: made on a stream of their own (pool
    streams do not wait for the default one) into pinned memory (a copy into pageable memory blocks the host), each
    None if not done within 5 s. On the CPU, plain copies."""
    if device.type != "cuda":
        return [t.clone() for t in tensors]
    stream = torch.cuda.Stream(device)
    with torch.cuda.stream(stream):
        host = [torch.empty(t.shape, dtype=t.dtype, pin_memory=True) for t in tensors]
        for h, t in zip(host, tensors):
            h.copy_(t, non_blocking=True)
    return host if finished_within(stream.query, 5.0) else [None] * len(tensors)


LAYER_WORDS = ("copied", "target", "filled", "claim")
"""Each rounds layer's table words the stall report reads (core.round_sync), then its gate's scores (core.slots)."""


def layer_tensors(rounds) -> list[torch.Tensor]:
    """Per rounds layer, its LAYER_WORDS, then its gate's used score, wasted score and closed-round count."""
    out = []
    for pager in rounds.pagers:
        state = pager.vram.kernel_state()
        out += [state[w] for w in LAYER_WORDS]
        out += [pager.vram.used_score, pager.vram.wasted_score, pager.vram.gate_closed]
    return out


def layer_words(rounds, read: list[torch.Tensor | None]) -> list[dict] | str:
    """Per rounds layer, what says which wait holds, from its layer_tensors read: its slots whose copy is under way
    (target above copied: the first few as [slot, copied, target, filled]), its claim word (forward, state), its
    gate's scores, and its mailbox's seq and count (pinned host memory: what the host copier was last handed)."""
    if any(t is None for t in read):
        return UNREAD
    per_layer = len(LAYER_WORDS) + 3
    out = []
    for i in range(len(rounds.pagers)):
        copied, target, filled, claim, *gate = read[i * per_layer : (i + 1) * per_layer]
        busy = (target > copied).nonzero().flatten().tolist()
        box = rounds.boxes[i]
        out.append(
            {
                "layer": i + 1,
                "under_way": len(busy),
                "first": [[s, int(copied[s]), int(target[s]), int(filled[s])] for s in busy[:4]],
                "claim": [int(claim[0]) >> 2, int(claim[0]) & 3],
                "used_wasted_closed": [int(g) for g in gate],
                "box_seq_count": [int(box[0]), int(box[1])],
            }
        )
    return out
