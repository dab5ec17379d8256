"""storage: where a plan puts the checkpoint and the paging file, and what the probe knows of those disks.

The draft makes one once its expert dtype is chosen; the SSD tier's source (ssd_choice) and the disk tables (disks)
read it, so neither needs the draft itself."""

from __future__ import annotations

import math
from dataclasses import dataclass

from bigmoe.machine.hardware import Disk, known
from bigmoe.plan.memory import CODEC_RATIO


@dataclass(frozen=True)
class Storage:
    """The checkpoint's and the paging file's directories and disks, and the bytes they take."""

    model_dir: str
    """Directory of the checkpoint (--model-dir, or the preset's default)."""
    paging_dir: str
    """Directory of the SSD tier's paging file (--paging-dir, or the default)."""
    model_disk: Disk | None
    """The probed disk under model_dir (None: not probed)."""
    paging_disk: Disk | None
    """The probed disk under paging_dir (None: not probed)."""
    checkpoint_bytes: int
    """The whole checkpoint at the planned expert dtype: dense weights, experts, n-gram table."""
    checkpoint_origin: str
    """Where the checkpoint comes from, in a few words (the disk table's reason)."""
    model_on_disk: bool
    """The checkpoint is there already, so it adds nothing to its disk."""
    layer_experts: int
    """Experts of one MoE layer."""
    moe_layers: int
    """MoE layers of the model (the paging file holds every expert of each)."""
    expert_bytes: int
    """Bytes of one raw expert record."""

    @property
    def same_disk(self) -> bool | None:
        """Whether checkpoint and paging file share a disk (None: a disk was not probed)."""
        a, b = self.model_disk, self.paging_disk
        if a is None or b is None:
            return None
        return a is b or (known(a.mount_point) and a.mount_point == b.mount_point and a.device == b.device)

    @property
    def checkpoint_new_bytes(self) -> int:
        """Bytes the checkpoint will add to its disk (0 when it is there already)."""
        return 0 if self.model_on_disk else self.checkpoint_bytes

    def paging_file_bytes(self, compress: bool) -> int:
        """Size of the paging file: every expert of every MoE layer, raw or at the codec's ratio (assumed)."""
        return math.ceil(self.layer_experts * self.moe_layers * self.expert_bytes * (CODEC_RATIO if compress else 1.0))

    def ssd_disk(self, ssd_source: str) -> Disk | None:
        """The disk the SSD tier reads from `ssd_source` (Plan.ssd_source), None for no SSD tier or no probe."""
        return {"paging file": self.paging_disk, "checkpoint": self.model_disk}.get(ssd_source)
