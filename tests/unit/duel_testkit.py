"""lfu-duel's twin tests: routing that makes its selector change sides, and the duel state to compare."""

from __future__ import annotations

import random

import torch
from bigmoe_pager.core.acquire_kernel import DUEL_STATE
from bigmoe_pager.core.slots import SlotTable

STATIONARY = 80
"""Steps of each stretch: stationary (the slow counts do better) and shifting (the fast counts do) in turn."""
SHIFT_EVERY = 10
"""Steps between moves of the shifting stretch's hot window."""


def shifting_ids(rng: random.Random, experts: int, tokens: int, k: int, step: int) -> list[list[int]]:
    """One step's ids [tokens][k]: in a stationary stretch, a fixed popular set of even experts drawn with weights
    1/rank; in a shifting one, a window of 12 odd experts moving by 7 every SHIFT_EVERY steps (the slow counts
    keep the popular ones it no longer needs); now and then a -1 pair."""
    rows = []
    for _ in range(tokens):
        if (step // STATIONARY) % 2 == 0:
            popular = list(range(0, experts, 2))[:28]
            row = rng.choices(popular, weights=[1 / (i + 1) for i in range(len(popular))], k=k)
        else:
            start = (step // SHIFT_EVERY) * 7
            row = [(2 * (start + rng.randrange(12)) + 1) % experts for _ in range(k)]  # odd: apart from the popular
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


def psel_side(table: SlotTable) -> int:
    """The side the selector is on: 1 (slow counts lead), -1 (fast ones lead) or 0 (fast, undecided)."""
    return int(table.psel.sign())
