"""The paging file: every expert record of a model in one file, for the SSD tier.

Used when records are compressed (the checkpoint cannot be read in place then).
Records are opaque bytes tagged with a codec name and version ("raw" = plain
layout bytes); decoding is the codec's job. On disk:

    [header, padded to ALIGN]  magic, format version, JSON metadata, index place, crc32 of JSON + index
    [index, padded to ALIGN]   per (layer, expert): offset u64, length u64, crc32 u32
    [records]                  each starts on an ALIGN boundary, zero padded, length <= layout pitch
    [trailer, ALIGN bytes]     end magic, file size, header crc32: present only in a finished file

The writer fills a temporary file next to the target, fsyncs it and renames it
into place, so a half-written file never carries the target's name; the trailer
check on open catches a file cut short anyway.

A record that fails its crc32 check when read marks the whole file damaged with a
sidecar `<name>.damaged` (one line: why); a file so marked is refused on open, so
the next start rebuilds it instead of failing on the same record again. A new
file committed in its place removes the marker.
"""

from __future__ import annotations

import dataclasses
import errno
import json
import os
import struct
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO, Callable

import numpy as np

from ..atomic_file import fsync_dir
from .expert_store import ExpertStore
from .layout import ExpertLayout
from .odirect import ALIGN, DirectFile, SystemFileIO, aligned_empty, as_byte_array
from .paging_names import damaged_marker, partial_file
from .read_stats import ReadCounters
from .record_reads import ReadsBuilder, RecordReads

MAGIC = b"BIGMOEPF"
END_MAGIC = b"BIGMOEOK"
FORMAT_VERSION = 1
_FIXED = struct.Struct("<8sIIQQI")  # magic, version, json bytes, index offset, index entries, crc32 of json + index
_ENTRY = struct.Struct("<QQI4x")  # offset, length, crc32 (24 bytes)
_TRAILER = struct.Struct("<8sQI")  # end magic, file size, header crc32


class PagingFileError(RuntimeError):
    """A paging file cannot be used or written; the message is one line naming the file and what to do."""


class DiskFullError(PagingFileError):
    """The disk filled while writing a paging file; the partial file was removed."""


class ChecksumError(RuntimeError):
    """A record's bytes do not match its stored crc32; the bytes must not be used."""


def damage_reason(path: str | os.PathLike) -> str | None:
    """Why the paging file at path was marked damaged, or None when it is not marked."""
    try:
        return damaged_marker(path).read_text().strip() or "marked damaged"
    except FileNotFoundError:
        return None
    except OSError as e:
        return f"its damage marker cannot be read ({e.strerror or e})"


def mark_damaged(path: str | os.PathLike, reason: str) -> bool:
    """Mark the paging file damaged (atomically: a marker is whole or absent); False when it cannot be written."""
    marker = damaged_marker(path)
    tmp = marker.with_name(f".{marker.name}.{os.getpid()}")
    try:
        tmp.write_text(reason.replace("\n", " ") + "\n")
        os.replace(tmp, marker)
        return True
    except OSError:
        tmp.unlink(missing_ok=True)
        return False


@dataclass(frozen=True)
class PagingFileMeta:
    """What a paging file was made for; a file is used only when all of it matches."""

    model_id: str
    """Hub id of the model, e.g. Qwen/Qwen3.6-35B-A3B-FP8."""
    revision: str
    """Model revision (commit hash) the records were read from."""
    layout_signature: str
    """ExpertLayout.signature() of the records."""
    num_layers: int
    """MoE layers."""
    num_experts: int
    """Experts per MoE layer."""
    codec: str = "raw"
    """Codec of the record bytes; "raw" = plain layout records."""
    codec_version: int = 0
    """Codec format version; bumping it invalidates old files."""


class PagingFileWriter:
    """Writes a paging file; use as a context manager, `add` every record once, then `commit`."""

    def __init__(
        self,
        path: str | os.PathLike,
        meta: PagingFileMeta,
        pitch: int,
        opener: Callable[[Path], BinaryIO] | None = None,
    ):
        self.path = Path(path)
        self.meta = meta
        self.pitch = pitch
        self.tmp = partial_file(self.path, os.getpid())
        self._json = json.dumps(dataclasses.asdict(meta), sort_keys=True).encode()
        self._entries = np.zeros((meta.num_layers * meta.num_experts, 3), dtype=np.uint64)
        self._written = np.zeros(meta.num_layers * meta.num_experts, dtype=bool)
        self._index_offset = _round_up(_FIXED.size + len(self._json), ALIGN)
        self._pos = self._index_offset + _round_up(len(self._entries) * _ENTRY.size, ALIGN)
        self._file: BinaryIO | None = None
        self._file = self._guard(lambda: (opener or _open_for_write)(self.tmp))
        self._guard(lambda: self._file.seek(self._pos))

    def __enter__(self) -> "PagingFileWriter":
        return self

    def __exit__(self, exc_type, *rest) -> None:
        if exc_type is not None or self._file is not None:
            self.abort()

    def add(self, layer: int, expert: int, record: object) -> None:
        """Append one record (bytes-like or uint8 tensor, <= pitch bytes) for (layer, expert)."""
        data = as_byte_array(record) if not isinstance(record, (bytes, bytearray)) else np.frombuffer(record, np.uint8)
        key = layer * self.meta.num_experts + expert
        if not (0 <= layer < self.meta.num_layers and 0 <= expert < self.meta.num_experts):
            raise PagingFileError(
                f"{self.path}: record ({layer}, {expert}) outside {self.meta.num_layers} x {self.meta.num_experts}"
            )
        if self._written[key]:
            raise PagingFileError(f"{self.path}: record ({layer}, {expert}) added twice")
        if data.nbytes > self.pitch:
            raise PagingFileError(
                f"{self.path}: record ({layer}, {expert}) is {data.nbytes} bytes, more than a RAM slot's {self.pitch}"
            )
        padded = _round_up(data.nbytes, ALIGN)
        self._guard(lambda: self._file.write(data.tobytes() + bytes(padded - data.nbytes)))
        self._entries[key] = (self._pos, data.nbytes, zlib.crc32(data))
        self._written[key] = True
        self._pos += padded

    def commit(self) -> Path:
        """Write index, header and trailer, fsync, rename into place; returns the final path."""
        if not self._written.all():
            key = int(np.flatnonzero(~self._written)[0])
            raise PagingFileError(
                f"{self.path}: {int((~self._written).sum())} records never added, "
                f"first ({key // self.meta.num_experts}, {key % self.meta.num_experts})"
            )
        index = b"".join(_ENTRY.pack(*map(int, row)) for row in self._entries)
        crc = zlib.crc32(self._json + index)
        fixed = _FIXED.pack(MAGIC, FORMAT_VERSION, len(self._json), self._index_offset, len(self._entries), crc)
        size = self._pos + ALIGN
        trailer = _TRAILER.pack(END_MAGIC, size, crc)

        def finish() -> None:
            self._file.write(trailer + bytes(ALIGN - len(trailer)))
            self._file.seek(0)
            self._file.write(fixed + self._json)
            self._file.seek(self._index_offset)
            self._file.write(index)
            self._file.flush()
            os.fsync(self._file.fileno())

        self._guard(finish)
        self._file.close()
        self._file = None
        os.replace(self.tmp, self.path)
        damaged_marker(self.path).unlink(missing_ok=True)  # the marker spoke of the file just replaced
        fsync_dir(self.path.parent)
        return self.path

    def abort(self) -> None:
        """Drop the partial file (safe to call twice)."""
        if self._file is not None:
            try:
                self._file.close()
            except OSError:
                pass  # a close after ENOSPC can fail again; the file is removed below anyway
            self._file = None
        self.tmp.unlink(missing_ok=True)

    def _guard(self, step: Callable[[], object]) -> object:
        """Run one write step; on any OS error remove the partial file and raise a one-line error."""
        try:
            return step()
        except OSError as e:
            self.abort()
            if e.errno in (errno.ENOSPC, errno.EDQUOT):
                raise DiskFullError(
                    f"disk full while writing {self.path} ({self._pos} bytes written so far); "
                    "free space or put the paging file on another disk (BIGMOE_PAGING_FILE)"
                ) from None
            raise PagingFileError(f"cannot write {self.path}: {e.strerror or e}") from None


def write_paging_file(
    path: str | os.PathLike,
    meta: PagingFileMeta,
    source: ExpertStore,
    opener: Callable[[Path], BinaryIO] | None = None,
    pitch: int | None = None,
) -> Path:
    """Copy every record of `source` (in key order; paging_build.EncodedStore gives compressed ones) into a new
    paging file at path. `pitch` bounds a record (default: the layout's; a compressed one can be a little larger)."""
    buf = aligned_empty(max(pitch or 0, source.layout.pitch)).numpy()
    with PagingFileWriter(path, meta, pitch or source.layout.pitch, opener=opener) as writer:
        for layer in range(meta.num_layers):
            for expert in range(meta.num_experts):
                n = source.read(layer, expert, buf)
                writer.add(layer, expert, buf[:n])
        return writer.commit()


class PagingFileStore:
    """ExpertStore over a finished paging file; every read is checked against its crc32."""

    def __init__(
        self,
        path: str | os.PathLike,
        layout: ExpertLayout,
        expect: PagingFileMeta,
        *,
        retries: int = 2,
        io: SystemFileIO | None = None,
        counters: ReadCounters | None = None,
        pitch: int | None = None,
    ):
        self.path = Path(path)
        self.layout = layout
        self.counters = counters if counters is not None else ReadCounters()
        if expect.layout_signature != layout.signature():
            raise ValueError("expect.layout_signature differs from layout.signature(); pass the layout the records use")
        self.pitch = pitch or layout.pitch
        self.meta, self._index = _open_index(self.path, expect, self.pitch)
        self.num_layers, self.num_experts, self.codec = self.meta.num_layers, self.meta.num_experts, self.meta.codec
        self._file = DirectFile(self.path, retries=retries, io=io, counters=self.counters)
        self._failed: set[int] = set()  # records whose last read failed its crc32 (set ops are atomic under the GIL)

    def read(self, layer: int, expert: int, dst: object) -> int:
        """Record bytes into dst[:length] (dst >= pitch bytes); ChecksumError if they do not match. A record
        failing twice in a row marks the file damaged (damaged_marker), so the next start rebuilds it."""
        offset, length, crc = self.entry(layer, expert)
        out = as_byte_array(dst)
        span = _round_up(length, ALIGN)
        if out.nbytes < span:
            raise ValueError(f"destination holds {out.nbytes} bytes; record ({layer}, {expert}) needs {span}")
        self._file.read_into(offset, out[:span])
        key = layer * self.num_experts + expert
        if zlib.crc32(out[:length]) == crc:
            self._failed.discard(key)
            return length
        self.counters.add_error()
        why = f"record ({layer}, {expert}) at offset {offset} fails its crc32 check"
        if key not in self._failed:  # once may be a glitch on the way (callers retry); twice is the bytes on disk
            self._failed.add(key)
            raise ChecksumError(f"paging file {self.path}: {why}")
        raise ChecksumError(self.record_failed_checks(layer, expert, 2))

    def record_reads(self) -> RecordReads:
        """Every record as one aligned read and one checked piece, for the native SSD reader."""
        plan = ReadsBuilder([self._file])
        for offset, length, crc in self._index:
            plan.piece(plan.read(self._file.path, int(offset), int(length)), 0, int(length))
            plan.end_key(int(length), int(crc))
        return plan.build([])

    def record_failed_checks(self, layer: int, expert: int, attempts: int) -> str:
        """What a record that failed its crc32 on every one of `attempts` reads means (the file is marked damaged
        when the reads were two or more: the bytes on disk, not a glitch on the way)."""
        offset, length, _ = self.entry(layer, expert)
        why = f"record ({layer}, {expert}) at offset {offset} fails its crc32 check"
        if attempts < 2:
            return f"paging file {self.path}: {why}"
        marked = mark_damaged(self.path, f"{why} {'twice' if attempts == 2 else f'{attempts} times'}")
        return (
            f"paging file {self.path} "
            + (
                "is marked damaged and the next start rebuilds it"
                if marked
                else f"is damaged: delete it (its marker {damaged_marker(self.path)} could not be written)"
            )
            + f": {why}"
        )

    def check_records(self, keys: list[int] | None = None) -> list[tuple[int, int]]:
        """(layer, expert) of each record whose bytes fail their crc32, reading `keys`
        (layer * experts + expert) or every record; the file is marked damaged when any fails."""
        bad = []
        buf = aligned_empty(_round_up(self.pitch, ALIGN)).numpy()
        for key in range(len(self._index)) if keys is None else keys:
            layer, expert = divmod(int(key), self.num_experts)
            offset, length, crc = self.entry(layer, expert)
            self._file.read_into(offset, buf[: _round_up(length, ALIGN)])
            if zlib.crc32(buf[:length]) != crc:
                bad.append((layer, expert))
        if bad:
            mark_damaged(self.path, f"{len(bad)} records fail their crc32 check, first {bad[0]}")
        return bad

    def describe(self, layer: int, expert: int) -> str:
        offset, length, _ = self.entry(layer, expert)
        return f"paging file {self.path} (layer {layer}, expert {expert} @{offset}+{length})"

    def close(self) -> None:
        self._file.close()

    def __enter__(self) -> "PagingFileStore":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def entry(self, layer: int, expert: int) -> tuple[int, int, int]:
        """The index entry of one record: (file offset, length in bytes, crc32)."""
        if not (0 <= layer < self.num_layers and 0 <= expert < self.num_experts):
            raise IndexError(
                f"expert ({layer}, {expert}) outside {self.num_layers} layers x {self.num_experts} experts"
            )
        offset, length, crc = self._index[layer * self.num_experts + expert]
        return int(offset), int(length), int(crc)


def read_meta(path: str | os.PathLike) -> PagingFileMeta:
    """What a whole, undamaged paging file was made for (its codec included); PagingFileError otherwise."""
    return _read_header(Path(path))[0]


def _open_index(path: Path, expect: PagingFileMeta, pitch: int) -> tuple[PagingFileMeta, np.ndarray]:
    """Validate header, trailer and index of a paging file made for `expect`; returns its metadata and index rows."""
    meta, index_bytes, size = _read_header(path)
    _check_meta(path, meta, expect)
    index = np.frombuffer(index_bytes, dtype=np.dtype([("o", "<u8"), ("n", "<u8"), ("c", "<u4"), ("p", "V4")]))
    table = np.stack([index["o"], index["n"], index["c"].astype(np.uint64)], axis=1)
    if (table[:, 0] % ALIGN).any() or (table[:, 1] > pitch).any() or (table[:, 0] + table[:, 1] > size - ALIGN).any():
        raise PagingFileError(f"{path}: paging file index points outside its records; delete it and run prepare again")
    return meta, table


def _read_header(path: Path) -> tuple[PagingFileMeta, bytes, int]:
    """The metadata, the index bytes and the file size of a paging file whose header, trailer and crc32 check."""
    damaged = damage_reason(path)
    if damaged is not None:
        raise PagingFileError(f"{path}: paging file was marked damaged ({damaged}); run prepare again to rebuild it")
    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            fixed = f.read(_FIXED.size)
            if len(fixed) < _FIXED.size or fixed[:8] != MAGIC:
                raise PagingFileError(f"{path}: not a bigmoe paging file (bad magic); delete it and run prepare again")
            _, version, json_len, index_offset, entries, crc = _FIXED.unpack(fixed)
            if version != FORMAT_VERSION:
                raise PagingFileError(
                    f"{path}: paging file format {version}, this bigmoe reads {FORMAT_VERSION}; run prepare again"
                )
            meta_bytes = f.read(json_len)
            f.seek(index_offset)
            index_bytes = f.read(entries * _ENTRY.size)
            f.seek(max(size - ALIGN, 0))
            trailer = f.read(_TRAILER.size)
    except OSError as e:
        raise PagingFileError(f"{path}: cannot read paging file: {e.strerror or e}") from None
    if len(trailer) < _TRAILER.size or _TRAILER.unpack(trailer) != (END_MAGIC, size, crc):
        raise PagingFileError(
            f"{path}: paging file is incomplete or truncated (no valid trailer); delete it and run prepare again"
        )
    if zlib.crc32(meta_bytes + index_bytes) != crc:
        raise PagingFileError(
            f"{path}: paging file header is corrupt (crc32 mismatch); delete it and run prepare again"
        )
    return PagingFileMeta(**json.loads(meta_bytes)), index_bytes, size


def sample_keys(records: int, count: int) -> list[int]:
    """`count` record keys spread evenly over `records` (first and last included); all when count >= records."""
    if count >= records:
        return list(range(records))
    return sorted({round(i * (records - 1) / max(count - 1, 1)) for i in range(count)})


def _check_meta(path: Path, got: PagingFileMeta, want: PagingFileMeta) -> None:
    for field in dataclasses.fields(PagingFileMeta):
        a, b = getattr(got, field.name), getattr(want, field.name)
        if a != b:
            raise PagingFileError(
                f"{path}: paging file was made for {field.name}={_short(a)}, this run needs {_short(b)}; "
                "delete it or run prepare again"
            )


def _short(value: object) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _open_for_write(path: Path) -> BinaryIO:
    return open(path, "wb")


def _round_up(n: int, m: int) -> int:
    return (n + m - 1) // m * m
