"""A store's records as plain aligned reads: what the native SSD reader (ssd_reader.c) executes.

Each record key (layer * experts + expert) is a few O_DIRECT reads, laid back to back in one staging buffer, and
the pieces of that buffer that make the record; the layout's gaps between components are zeroed after them. A
store that can say this (`CheckpointStore`, `PagingFileStore`: `record_reads()`) can be served without Python on
the read path; the plan is built once, when the service starts.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .odirect import ALIGN, DirectFile


@dataclass(frozen=True)
class RecordReads:
    """Every record of a store as aligned reads and pieces (int64 arrays; K = layers x experts keys)."""

    files: tuple[DirectFile, ...]
    """Open O_DIRECT files the reads name by index; the store keeps them open."""
    key_reads: np.ndarray
    """[K + 1]: key k's reads are reads[key_reads[k] : key_reads[k + 1]]."""
    reads: np.ndarray
    """[N, 4]: file index, file offset (aligned), bytes to read (aligned), bytes that must arrive (a read may
    end past the file's end, where O_DIRECT returns less)."""
    key_pieces: np.ndarray
    """[K + 1]: key k's pieces are pieces[key_pieces[k] : key_pieces[k + 1]]."""
    pieces: np.ndarray
    """[P, 3]: offset in the key's staging (its reads back to back), offset in the record, bytes."""
    record_bytes: np.ndarray
    """[K]: bytes of each record (what read counters count)."""
    crc: np.ndarray
    """[K]: crc32 of the record's pieces in order, or -1 when the store has none to check."""
    zeros: np.ndarray
    """[Z, 2]: record byte ranges [start, end) zeroed after the pieces (the layout's alignment gaps)."""

    @property
    def staging_bytes(self) -> int:
        """The largest staging any key needs (bytes)."""
        lengths = np.add.reduceat(self.reads[:, 2], self.key_reads[:-1]) if len(self.reads) else np.zeros(1)
        return int(lengths.max())


class ReadsBuilder:
    """Collects reads and pieces key by key, in key order."""

    def __init__(self, files: list[DirectFile]):
        self.files = files
        self._index = {f.path: i for i, f in enumerate(files)}
        self.key_reads, self.reads, self.key_pieces, self.pieces = [0], [], [0], []
        self.record_bytes: list[int] = []
        self.crc: list[int] = []
        self._staged = 0

    def read(self, path: str, offset: int, length: int) -> int:
        """Add an aligned read covering file bytes [offset, offset + length); returns where `offset` lands in the
        key's staging."""
        start = offset - offset % ALIGN
        span = -(-(offset + length - start) // ALIGN) * ALIGN
        self.reads.append((self._index[path], start, span, offset + length - start))
        at = self._staged + offset - start
        self._staged += span
        return at

    def piece(self, staged: int, record_offset: int, nbytes: int) -> None:
        self.pieces.append((staged, record_offset, nbytes))

    def end_key(self, record_bytes: int, crc: int = -1) -> None:
        self.key_reads.append(len(self.reads))
        self.key_pieces.append(len(self.pieces))
        self.record_bytes.append(record_bytes)
        self.crc.append(crc)
        self._staged = 0

    def build(self, zeros: list[tuple[int, int]]) -> RecordReads:
        def ints(rows: list, width: int) -> np.ndarray:
            return np.asarray(rows, dtype=np.int64).reshape(-1, width)

        return RecordReads(
            files=tuple(self.files),
            key_reads=np.asarray(self.key_reads, dtype=np.int64),
            reads=ints(self.reads, 4),
            key_pieces=np.asarray(self.key_pieces, dtype=np.int64),
            pieces=ints(self.pieces, 3),
            record_bytes=np.asarray(self.record_bytes, dtype=np.int64),
            crc=np.asarray(self.crc, dtype=np.int64),
            zeros=ints(zeros, 2),
        )
