"""prepare: the SSD tier's paging file, built when the plan needs one and reused
while its header still matches the checkpoint, layout and codec.

The file is written beside its final path and renamed into place only when
complete (bigmoe_pager.core.paging_file), so a crash mid-build leaves nothing
that looks valid; the next start builds it again.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Callable

from bigmoe.errors import BigmoeError

Progress = Callable[[str, dict], None]


class PrepareError(BigmoeError):
    """The paging file could not be built."""


def prepare(plan, model_path: Path, progress: Progress = lambda e, f: None) -> Path | None:
    """Make sure the plan's paging file exists and fits this checkpoint; return its path (None = not needed)."""
    if plan.ssd_source != "paging file" or not plan.paging_file:
        return None
    path = Path(plan.paging_file)
    if paging_file_matches(path, model_path, plan.compress):
        progress("prepare", {"state": "reused", "path": str(path)})
        return path
    return build(path, model_path, plan.compress, progress)


def paging_file_matches(path: Path, model_path: Path, compressed: bool) -> bool:
    """True when the file at path is complete and was made from this checkpoint with this codec setting."""
    from bigmoe_pager.core.paging_build import checkpoint_meta, layout_for_checkpoint
    from bigmoe_pager.core.paging_file import PagingFileError, PagingFileStore
    from bigmoe_pager.core.safetensors_index import CheckpointError

    if not path.is_file():
        return False
    try:
        layout = layout_for_checkpoint(model_path)
        from bigmoe_pager.core.expert_store import CheckpointStore

        probe = CheckpointStore(model_path, layout)
        layers, experts = probe.num_layers, probe.num_experts
        probe.close()
        codec, version = _codec(compressed)
        from bigmoe_pager.core.paging_build import compressed_pitch

        pitch = compressed_pitch(layout) if compressed else None
        PagingFileStore(path, layout, checkpoint_meta(model_path, layout, layers, experts, codec, version), pitch=pitch).close()
        return True
    except (PagingFileError, CheckpointError, OSError, ValueError):
        return False


def build(path: Path, model_path: Path, compressed: bool, progress: Progress) -> Path:
    from bigmoe_pager.core.paging_build import build_paging_file
    from bigmoe_pager.core.paging_file import PagingFileError
    from bigmoe_pager.core.safetensors_index import CheckpointError

    path.parent.mkdir(parents=True, exist_ok=True)
    start = time.monotonic()
    last = [0.0]

    def report(done: int, total: int) -> None:
        now = time.monotonic()
        if now - last[0] >= 0.5 or done == total:
            last[0] = now
            progress("prepare", {"state": "building", "records_done": done, "records_total": total,
                                 "elapsed_s": round(now - start, 1)})

    progress("prepare", {"state": "building", "path": str(path), "compressed": compressed})
    try:
        out = build_paging_file(model_path, path, compressed, report)
    except (PagingFileError, CheckpointError, OSError) as e:
        raise PrepareError(f"cannot build the paging file {path}: {e}") from None
    progress("prepare", {"state": "built", "path": str(out), "bytes": out.stat().st_size,
                         "seconds": round(time.monotonic() - start, 1)})
    return out


def _codec(compressed: bool) -> tuple[str, int]:
    if not compressed:
        return "raw", 0
    from bigmoe_pager.codec import CODEC_NAME, CODEC_VERSION

    return CODEC_NAME, CODEC_VERSION
