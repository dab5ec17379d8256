"""lfu-duel's twin tests: routing that makes its selectors change sides, and the duel state to compare."""

from __future__ import annotations

import random

import torch
from bigmoe_pager.core.acquire_kernel import DUEL_STATE
from bigmoe_pager.core.slots import SlotTable

STATIONARY = 80
"""Steps of each stretch: stationary (the slow counts do better), shifting (the fast counts do) and sliding
(recency alone does) in turn."""
SHIFT_EVERY = 10
"""Steps between moves of the shifting stretch's hot window."""


def shifting_ids(rng: random.Random, experts: int, tokens: int, k: int, step: int) -> list[list[int]]:
    """One step's ids [tokens][k]: in a stationary stretch, a fixed popular set of even experts drawn with weights
    1/rank; in a shifting one, a window of 12 odd experts moving by 7 every SHIFT_EVERY steps (the slow counts
    keep the popular ones it no longer needs); in a sliding one, a window of 10 odd experts moving by 1 every step
    (any counts keep the ones it has just left over the ones it has just reached); now and then a -1 pair."""
    rows = []
    for _ in range(tokens):
        stretch = (step // STATIONARY) % 3
        if stretch == 0:
            popular = list(range(0, experts, 2))[:28]
            row = rng.choices(popular, weights=[1 / (i + 1) for i in range(len(popular))], k=k)
        else:
            start, width = ((step // SHIFT_EVERY) * 7, 12) if stretch == 1 else (step, 10)
            row = [(2 * (start + rng.randrange(width)) + 1) % experts for _ in range(k)]  # odd: apart from the popular
        if rng.random() < 0.1:
            row[rng.randrange(k)] = -1
        rows.append(row)
    return rows


def duel_state(table: SlotTable) -> dict[str, torch.Tensor]:
    """lfu-duel's tensors of a table (both counts, both shadows' held bytes and stamps, psel), without write sinks."""
    if not table.duel:
        return {}
    state = table.kernel_state()
    return {name: state[name][: table.num_experts] if state[name].dim() else state[name] for name in DUEL_STATE}


def psel_side(table: SlotTable) -> tuple[int, int]:
    """The sides the selectors are on: psel's 1 (slow counts lead), -1 (fast ones lead) or 0 (fast, undecided), and
    psel_lru's 1 (recency alone leads), -1 or 0 (the counts psel names lead)."""
    return int(table.psel.sign()), int(table.psel_lru.sign())


def led_by_each(sides: set[tuple[int, int]]) -> bool:
    """Whether the steps of `sides` (psel_side's) were ranked by each leader: the fast counts, the slow ones and
    recency alone."""
    ranked = {"lru" if lru > 0 else "slow" if psel > 0 else "fast" for psel, lru in sides}
    return ranked == {"fast", "slow", "lru"}
