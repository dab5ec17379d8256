"""measure_disk: how fast a disk serves the SSD tier's kind of reads: multi-MiB O_DIRECT reads,
a few in flight, from a real file on that disk (a large file already there, such as a
checkpoint shard, or a temporary file written for the purpose), bounded in time and bytes.

O_DIRECT bypasses the page cache, so the rate is the disk's, not RAM's. Never raises: a disk
that cannot be measured gives Unknown(reason).
"""

from __future__ import annotations

import mmap
import os
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from bigmoe.machine.hardware import Unknown
from bigmoe.paths import nearest_dir

CHUNK_BYTES = 8 << 20
"""Bytes per read: whole experts are MiB-sized, so the SSD tier reads in MiB units too."""
IN_FLIGHT = 4
"""Reads outstanding at once (one thread each; os.preadv releases the GIL)."""
MAX_BYTES = 256 << 20
"""Bytes read at most."""
MAX_SECONDS = 1.0
"""Seconds of reading at most (a slow disk stops early, its rate still known)."""
MIN_BYTES = 32 << 20
"""Fewer bytes than this read say too little about a disk; the measurement is then Unknown."""
TEMP_FILE_BYTES = 64 << 20
"""Size of the temporary file written when the directory holds no file large enough to read."""
SCAN_LIMIT = 4000
"""Directory entries looked at, at most, when searching for a large file to read."""
ALIGN = 4096
"""Offsets and lengths of O_DIRECT reads are multiples of this (covers 512 B and 4 KiB sectors)."""


@dataclass(frozen=True)
class DiskRead:
    """One measured read rate."""

    gbps: float
    """Bytes read / seconds taken / 1e9."""
    bytes_read: int
    """Bytes read."""
    seconds: float
    """Wall time of the reads."""
    source: str
    """The file read ("a temporary file" when one was written)."""

    @property
    def basis(self) -> str:
        return (
            f"{self.bytes_read >> 20} MiB of {CHUNK_BYTES >> 20} MiB O_DIRECT reads, {IN_FLIGHT} in flight, "
            f"in {self.seconds:.2f} s from {self.source}"
        )


def measure_read_rate(
    directory: Path, max_bytes: int = MAX_BYTES, max_seconds: float = MAX_SECONDS
) -> DiskRead | Unknown:
    """The O_DIRECT read rate of the disk holding `directory` (it, or its nearest existing ancestor)."""
    if not hasattr(os, "O_DIRECT"):
        return Unknown("this OS has no O_DIRECT")
    directory = nearest_dir(directory)
    sample = find_large_file(directory, MIN_BYTES)
    if sample is not None:
        return _measure(sample, str(sample), max_bytes, max_seconds)
    try:
        fd, name = tempfile.mkstemp(prefix=".bigmoe-readrate-", dir=directory)
    except OSError as e:
        return Unknown(
            f"no file of {MIN_BYTES >> 20} MiB in {directory} to read, "
            f"and a test file cannot be written there ({e.strerror or e})"
        )
    try:
        with os.fdopen(fd, "wb") as f:
            block = os.urandom(1 << 20)  # incompressible, so a compressing filesystem stores every byte
            for _ in range(TEMP_FILE_BYTES >> 20):
                f.write(block)
            f.flush()
            os.fsync(f.fileno())
        return _measure(
            Path(name), f"a {TEMP_FILE_BYTES >> 20} MiB temporary file in {directory}", max_bytes, max_seconds
        )
    except OSError as e:
        return Unknown(f"writing a {TEMP_FILE_BYTES >> 20} MiB test file in {directory} failed ({e.strerror or e})")
    finally:
        Path(name).unlink(missing_ok=True)


def find_large_file(directory: Path, min_bytes: int) -> Path | None:
    """The largest plain file of at least `min_bytes` under `directory` (symlinks to files on the
    same filesystem count: the Hub cache's snapshots link to its blobs); None when there is none."""
    try:
        device = directory.stat().st_dev
    except OSError:
        return None
    best: tuple[int, Path] | None = None
    seen = 0
    for base, dirs, files in os.walk(directory):
        dirs[:] = [d for d in dirs if not d.startswith(".")]
        for name in files:
            seen += 1
            if seen > SCAN_LIMIT:
                return best[1] if best else None
            path = Path(base) / name
            try:
                stat = path.stat()
            except OSError:
                continue
            if stat.st_dev == device and stat.st_size >= min_bytes and os.access(path, os.R_OK):
                if best is None or stat.st_size > best[0]:
                    best = (stat.st_size, path)
    return best[1] if best else None


def _measure(path: Path, source: str, max_bytes: int, max_seconds: float) -> DiskRead | Unknown:
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
    except OSError as e:
        return Unknown(f"open({path}, O_DIRECT) failed: {e.strerror or e}")
    try:
        size = os.fstat(fd).st_size
        chunks = min(max_bytes, size) // CHUNK_BYTES
        if chunks * CHUNK_BYTES < MIN_BYTES:
            return Unknown(f"{path} holds {size >> 20} MiB, less than the {MIN_BYTES >> 20} MiB a measurement needs")
        done, seconds, error = _read_chunks(fd, chunks, max_seconds)
    finally:
        os.close(fd)
    if error is not None:
        return Unknown(f"an O_DIRECT read of {path} failed: {error}")
    if done < MIN_BYTES or seconds <= 0:
        return Unknown(f"only {done >> 20} MiB of {path} were read in {seconds:.2f} s, too few to judge the disk")
    return DiskRead(round(done / seconds / 1e9, 3), done, round(seconds, 3), source)


def _read_chunks(fd: int, chunks: int, max_seconds: float) -> tuple[int, float, str | None]:
    """(bytes read, seconds, error or None): IN_FLIGHT threads take chunk numbers in turn until
    every chunk is read or max_seconds pass."""
    lock = threading.Lock()
    state = {"next": 0, "bytes": 0, "error": None}
    start = time.perf_counter()
    deadline = start + max_seconds

    def worker() -> None:
        buffer = mmap.mmap(-1, CHUNK_BYTES)  # page-aligned, as O_DIRECT needs
        try:
            while time.perf_counter() < deadline:
                with lock:
                    if state["next"] >= chunks or state["error"]:
                        return
                    index = state["next"]
                    state["next"] += 1
                try:
                    got = os.preadv(fd, [buffer], index * CHUNK_BYTES)
                except OSError as e:
                    with lock:
                        state["error"] = e.strerror or str(e)
                    return
                if got != CHUNK_BYTES:
                    with lock:
                        state["error"] = f"a read at chunk {index} returned {got} of {CHUNK_BYTES} bytes"
                    return
                with lock:
                    state["bytes"] += got
        finally:
            buffer.close()

    with ThreadPoolExecutor(IN_FLIGHT) as pool:
        futures = [pool.submit(worker) for _ in range(IN_FLIGHT)]
    seconds = time.perf_counter() - start
    failed = next((f.exception() for f in futures if f.exception() is not None), None)
    return state["bytes"], seconds, state["error"] or (f"{type(failed).__name__}: {failed}" if failed else None)
