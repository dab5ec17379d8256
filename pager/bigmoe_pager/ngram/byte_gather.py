"""Cut fixed-size rows out of a byte buffer at arbitrary offsets, all at once.

numpy gathers whole elements, so the buffer is viewed as the widest element
(up to 32 bytes) that divides the row size and every offset; a 160-byte row is
then 5 element copies instead of 160 byte copies.
"""

from __future__ import annotations

from math import gcd

import numpy as np


def cut_rows(buf: np.ndarray, at: np.ndarray, row_bytes: int, out: np.ndarray) -> None:
    """out[i] = buf[at[i] : at[i] + row_bytes] for every i; out is C-contiguous uint8 [n, row_bytes]."""
    unit = gcd(row_bytes, int(np.gcd.reduce(at)) if at.size else 0)
    unit = max(u for u in (32, 16, 8, 4, 2, 1) if unit % u == 0)
    word = np.dtype((np.void, unit))
    src = buf[: buf.size // unit * unit].view(word)
    idx = (at // unit)[:, None] + np.arange(row_bytes // unit)
    np.take(src, idx, out=out.view(word).reshape(idx.shape))
