"""A safetensors shard's header, read without torch (the app reads it to plan; the pager to index).

A safetensors file is an 8-byte little-endian header length N, then N bytes of JSON
({name: {dtype, shape, data_offsets: [begin, end]}}), then the data.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

MAX_HEADER_BYTES = 512 << 20  # bytes; far above any real header, guards against reading garbage as a length


class CheckpointError(RuntimeError):
    """A checkpoint file is missing, malformed, truncated or does not match what the pager needs."""


def read_header(path: Path) -> tuple[dict, int]:
    """The parsed JSON header of one shard and the absolute offset where its data starts."""
    size = path.stat().st_size
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise CheckpointError(f"{path}: {size} bytes, too short to be a safetensors file")
        (n,) = struct.unpack("<Q", head)
        if n > MAX_HEADER_BYTES or 8 + n > size:
            raise CheckpointError(
                f"{path}: header length {n} does not fit a {size}-byte file; not safetensors or truncated"
            )
        try:
            header = json.loads(f.read(n))
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise CheckpointError(
                f"{path}: header is not valid JSON ({e.__class__.__name__}); not a safetensors file"
            ) from None
    if not isinstance(header, dict):
        raise CheckpointError(f"{path}: header is not a JSON object; not a safetensors file")
    return header, 8 + n
