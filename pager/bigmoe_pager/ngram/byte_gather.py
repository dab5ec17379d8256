"""Cut fixed-size rows out of a byte buffer at arbitrary offsets, all at once.

The buffer is viewed (no copy) as overlapping windows, window i being the
row_bytes starting at byte i, and the rows are taken with one fancy index:
numpy then copies each row as one contiguous run. Measured on 32,768 rows of
160 bytes: 4 ms, against 13 ms for gathering 8-byte words by a 2-D index.
"""

from __future__ import annotations

import numpy as np
from numpy.lib.stride_tricks import as_strided


def cut_rows(buf: np.ndarray, at: np.ndarray, row_bytes: int, out: np.ndarray) -> None:
    """out[i] = buf[at[i] : at[i] + row_bytes] for every i; buf is 1-D uint8, out C-contiguous uint8 [n, row_bytes]."""
    if at.size == 0:
        return
    if buf.size < row_bytes:
        raise IndexError(f"a {row_bytes}-byte row cannot lie in a buffer of {buf.size} bytes")
    step = buf.strides[0]
    windows = as_strided(buf, shape=(buf.size - row_bytes + 1, row_bytes), strides=(step, step), writeable=False)
    out[...] = windows[at]  # an offset past the last window raises IndexError, never reads outside buf
