"""Choosing a component's code tables: cluster chunk histograms, one Huffman code per cluster.

A table costs LUT_ENTRIES bytes in the record, so a new table is kept only when
the bits it saves outweigh it. Lloyd iterations alternate between giving every
chunk its cheapest table and rebuilding each table from its chunks' histograms.
"""

from __future__ import annotations

import numpy as np

from .format import LUT_ENTRIES, MAX_TABLES
from .huffman import CodeTable, build_table

LLOYD_ROUNDS = 2  # refinement rounds after each new table
TABLE_BITS = 8 * LUT_ENTRIES  # what one more table costs in the record


def choose_tables(hist: np.ndarray, max_tables: int = MAX_TABLES - 1) -> tuple[list[CodeTable], np.ndarray, np.ndarray]:
    """(tables, table index per chunk, bits per chunk) for chunk histograms [chunks, 16].

    max_tables leaves room for the verbatim table the encoder may add.
    """
    hist = np.asarray(hist, np.float64)
    tables = [build_table(hist.sum(axis=0))]
    assign, bits = _assign(hist, tables)
    ideal = _entropy_bits(hist)
    while len(tables) < max_tables:
        excess = bits - ideal
        seed = int(np.argmax(excess))
        if excess[seed] <= TABLE_BITS:
            break
        trial = tables + [build_table(hist[seed])]
        t_assign, t_bits = _assign(hist, trial)
        for _ in range(LLOYD_ROUNDS):
            trial = [build_table(hist[t_assign == k].sum(axis=0)) for k in range(len(trial)) if (t_assign == k).any()]
            t_assign, t_bits = _assign(hist, trial)
        if t_bits.sum() + TABLE_BITS * len(trial) >= bits.sum() + TABLE_BITS * len(tables):
            break
        tables, assign, bits = trial, t_assign, t_bits
    return tables, assign, bits


def _assign(hist: np.ndarray, tables: list[CodeTable]) -> tuple[np.ndarray, np.ndarray]:
    costs = np.stack([t.cost_bits(hist) for t in tables], axis=1)
    assign = np.argmin(costs, axis=1)
    return assign, costs[np.arange(len(hist)), assign]


def _entropy_bits(hist: np.ndarray) -> np.ndarray:
    """Empirical entropy of each row, in bits for the whole row: the floor no table beats."""
    total = hist.sum(axis=1, keepdims=True)
    p = np.divide(hist, total, out=np.zeros_like(hist), where=total > 0)
    logs = np.log2(p, out=np.zeros_like(p), where=p > 0)
    return -(hist * logs).sum(axis=1)
