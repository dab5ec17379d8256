"""Length-limited canonical Huffman codes over the 16 exponent values, and their decode LUTs."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .format import LUT_ENTRIES, MAX_CODE_BITS, VERBATIM_BITS

SYMBOLS = 16  # exponent field values
ABSENT = -1  # code length of a symbol the table cannot code


@dataclass(frozen=True)
class CodeTable:
    """One prefix code for exponent values."""

    lengths: np.ndarray
    """int8 [16]: code length in bits (0 when the table codes a single symbol), ABSENT if not coded."""
    codes: np.ndarray
    """uint32 [16]: canonical code values (0 for absent symbols)."""

    @property
    def lut(self) -> np.ndarray:
        """uint8 [LUT_ENTRIES]: for every value of the next MAX_CODE_BITS bits, symbol | length << 4."""
        lut = np.zeros(LUT_ENTRIES, np.uint8)
        for s in np.flatnonzero(self.lengths >= 0):
            n = int(self.lengths[s])
            lo = int(self.codes[s]) << (MAX_CODE_BITS - n)
            lut[lo : lo + (1 << (MAX_CODE_BITS - n))] = s | (n << 4)
        return lut

    def cost_bits(self, counts: np.ndarray) -> np.ndarray:
        """Bits to code each row of counts [..., 16] (inf where a row has a symbol the table lacks)."""
        lengths = np.where(self.lengths >= 0, self.lengths, 0).astype(np.float64)
        bits = counts @ lengths
        uncovered = (counts[..., self.lengths < 0] > 0).any(axis=-1)
        return np.where(uncovered, np.inf, bits)


def build_table(counts: np.ndarray, max_bits: int = MAX_CODE_BITS) -> CodeTable:
    """The optimal prefix code of lengths <= max_bits for these symbol counts (symbols with count 0 get no code)."""
    present = [int(s) for s in np.flatnonzero(np.asarray(counts) > 0)]
    lengths = np.full(SYMBOLS, ABSENT, np.int8)
    if len(present) == 1:
        lengths[present[0]] = 0  # a single value needs no bits at all
    elif present:
        for s, n in zip(present, _package_merge([int(counts[s]) for s in present], max_bits)):
            lengths[s] = n
    return CodeTable(lengths, canonical_codes(lengths))


def verbatim_table() -> CodeTable:
    """The identity code: every exponent as its own 4 bits (chunks that would not shrink)."""
    lengths = np.full(SYMBOLS, VERBATIM_BITS, np.int8)
    return CodeTable(lengths, np.arange(SYMBOLS, dtype=np.uint32))


def canonical_codes(lengths: np.ndarray) -> np.ndarray:
    """Canonical code values: symbols sorted by (length, value) get consecutive codes."""
    codes = np.zeros(SYMBOLS, np.uint32)
    code, prev = 0, 0
    for s in sorted(np.flatnonzero(lengths >= 0), key=lambda s: (int(lengths[s]), int(s))):
        n = int(lengths[s])
        code <<= n - prev
        codes[s] = code
        code, prev = code + 1, n
    return codes


def _package_merge(weights: list[int], max_bits: int) -> list[int]:
    """Code lengths (<= max_bits) minimising sum(weight * length), for >= 2 weights."""
    if len(weights) > (1 << max_bits):
        raise ValueError(f"{len(weights)} symbols cannot be coded in {max_bits} bits")
    # An item is (weight, per-symbol multiplicity); the lengths are how often each
    # symbol appears in the 2n-2 lightest items of the last level.
    leaves = sorted(((w, _unit(i, len(weights))) for i, w in enumerate(weights)), key=lambda it: it[0])
    level = leaves
    for _ in range(max_bits - 1):
        packages = [
            (level[i][0] + level[i + 1][0], _add(level[i][1], level[i + 1][1])) for i in range(0, len(level) - 1, 2)
        ]
        level = sorted(leaves + packages, key=lambda it: it[0])
    lengths = [0] * len(weights)
    for _, mult in level[: 2 * len(weights) - 2]:
        lengths = _add(lengths, mult)
    return lengths


def _unit(i: int, n: int) -> list[int]:
    v = [0] * n
    v[i] = 1
    return v


def _add(a: list[int], b: list[int]) -> list[int]:
    return [x + y for x, y in zip(a, b)]
