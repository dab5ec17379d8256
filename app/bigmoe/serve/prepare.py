"""prepare: the SSD tier's paging file, built when the plan needs one and reused
only after it is checked: its header still matches the checkpoint, layout and codec,
no run marked it damaged, and its records pass their crc32 checks (all of them, or
a sample for files above FULL_CHECK_BYTES; the pager checks every record it reads).

The file is written beside its final path and renamed into place only when
complete (bigmoe_pager.core.paging_file), so a crash mid-build leaves nothing
that looks valid; the next start builds it again.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Callable

from bigmoe.errors import BigmoeError
from bigmoe.paths import make_dir

Progress = Callable[[str, dict], None]


class PrepareError(BigmoeError):
    """The paging file could not be built."""


FULL_CHECK_BYTES = 1 << 30
"""Paging files up to this size have every record's crc32 checked at each start (crc32 runs at ~2 GB/s per
core, so the disk's read speed decides: ~0.5 s on an NVMe SSD). Larger ones (the reference job's is ~100 GiB,
a minute or more even on NVMe) get header, index, size and a sample of SAMPLE_BYTES checked at start, and
every record is checked again as the pager reads it (a failure marks the file for rebuild)."""
SAMPLE_BYTES = 256 << 20
"""Record bytes checked at start in a paging file above FULL_CHECK_BYTES, spread evenly over the file."""
MIN_SAMPLE_RECORDS = 8
"""Records checked at least, however big each record is."""


def prepare(plan, model_path: Path, progress: Progress = lambda e, f: None) -> Path | None:
    """Make sure the plan's paging file exists, fits this checkpoint and passes its checks; return its
    path (None = not needed). A file that fails any check is rebuilt, never reused."""
    if plan.ssd_source != "paging file" or not plan.paging_file:
        return None
    path = Path(plan.paging_file)
    _require_odirect(path.parent)  # before any byte is written: the pager could not read the file
    start = time.monotonic()
    why_not = check_paging_file(path, model_path, plan.compress)
    if why_not is None:
        progress(
            "prepare",
            {
                "state": "reused",
                "path": str(path),
                "checked": _checked_what(path),
                "seconds": round(time.monotonic() - start, 2),
            },
        )
        return path
    if path.exists():
        progress("prepare", {"state": "rebuilding", "path": str(path), "reason": why_not})
    return build(path, model_path, plan.compress, progress)


def paging_file_matches(path: Path, model_path: Path, compressed: bool) -> bool:
    """True when the file at path is complete, made from this checkpoint with this codec setting, and sound."""
    return check_paging_file(path, model_path, compressed) is None


def check_paging_file(
    path: Path, model_path: Path, compressed: bool, full_check_bytes: int = FULL_CHECK_BYTES
) -> str | None:
    """Why the paging file at path must not be used (one line), or None when it passes: header, trailer,
    index, binding to this checkpoint/layout/codec, no damage marker, and the records' crc32s (all of
    them up to full_check_bytes, SAMPLE_BYTES of them evenly spread above)."""
    from bigmoe_pager.core.expert_store import CheckpointStore
    from bigmoe_pager.core.odirect import ODirectError, ReadError
    from bigmoe_pager.core.paging_build import checkpoint_meta, compressed_pitch, layout_for_checkpoint
    from bigmoe_pager.core.paging_file import PagingFileError, PagingFileStore, sample_keys
    from bigmoe_pager.core.safetensors_index import CheckpointError

    if not path.is_file():
        return "there is no paging file yet"
    try:
        layout = layout_for_checkpoint(model_path)
        with CheckpointStore(model_path, layout) as probe:
            layers, experts = probe.num_layers, probe.num_experts
        codec, version = _codec(compressed)
        meta = checkpoint_meta(model_path, layout, layers, experts, codec, version)
        with PagingFileStore(path, layout, meta, pitch=compressed_pitch(layout) if compressed else None) as store:
            keys = (
                None
                if path.stat().st_size <= full_check_bytes
                else sample_keys(layers * experts, sample_records(layout.record_bytes))
            )
            bad = store.check_records(keys)
    except ODirectError as e:  # rebuilding would not help: the disk is the problem
        raise PrepareError(str(e)) from None
    except (PagingFileError, CheckpointError, ReadError, OSError, ValueError) as e:
        return str(e)
    if bad:
        return f"{len(bad)} of its records fail their crc32 check (first: layer {bad[0][0]}, expert {bad[0][1]})"
    return None


def sample_records(record_bytes: int) -> int:
    """Records to check at start in a file above FULL_CHECK_BYTES."""
    return max(MIN_SAMPLE_RECORDS, SAMPLE_BYTES // max(record_bytes, 1))


def _checked_what(path: Path) -> str:
    if path.stat().st_size <= FULL_CHECK_BYTES:
        return "every record"
    return f"header and {SAMPLE_BYTES >> 20} MiB of records"


def build(path: Path, model_path: Path, compressed: bool, progress: Progress) -> Path:
    from bigmoe_pager.core.paging_build import build_paging_file
    from bigmoe_pager.core.paging_file import PagingFileError
    from bigmoe_pager.core.safetensors_index import CheckpointError

    path.parent.mkdir(parents=True, exist_ok=True)
    for stale in stale_partials(path):
        stale.unlink(missing_ok=True)
        progress("prepare", {"state": "removed", "path": str(stale), "reason": "left by a build that died"})
    start = time.monotonic()
    last = [0.0]

    def report(done: int, total: int) -> None:
        now = time.monotonic()
        if now - last[0] >= 0.5 or done == total:
            last[0] = now
            progress(
                "prepare",
                {"state": "building", "records_done": done, "records_total": total, "elapsed_s": round(now - start, 1)},
            )

    progress("prepare", {"state": "building", "path": str(path), "compressed": compressed})
    try:
        out = build_paging_file(model_path, path, compressed, report)
    except (PagingFileError, CheckpointError, OSError) as e:
        raise PrepareError(f"cannot build the paging file {path}: {e}") from None
    progress(
        "prepare",
        {
            "state": "built",
            "path": str(out),
            "bytes": out.stat().st_size,
            "seconds": round(time.monotonic() - start, 1),
        },
    )
    return out


def stale_partials(path: Path) -> list[Path]:
    """Temporary files of the paging file at `path` whose build died before renaming them (each as large as the
    file it was writing): removed before a build, counted as free space by preflight, listed by `bigmoe list`."""
    from bigmoe_pager.core.paging_names import partial_files

    return [p.path for p in partial_files(path) if not p.writing]


def _require_odirect(directory: Path) -> None:
    from bigmoe_pager.core.odirect import odirect_works

    fix = "name a writable directory on a local SSD with --paging-dir"
    make_dir(directory, PrepareError, "the paging directory", fix)
    ok, why = odirect_works(directory)
    if not ok:
        raise PrepareError(
            f"O_DIRECT reads do not work in {directory} ({why}); the pager reads the paging file "
            "with O_DIRECT: put it on a local SSD filesystem (--paging-dir)"
        )


def _codec(compressed: bool) -> tuple[str, int]:
    if not compressed:
        return "raw", 0
    from bigmoe_pager.codec import CODEC_NAME, CODEC_VERSION

    return CODEC_NAME, CODEC_VERSION
