"""Shared fixtures: synthetic Qwen3-MoE checkpoints made once per test session."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest


def _cuda_present() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return torch.cuda.is_available()


# Without a GPU, Triton kernels run in Triton's interpreter. Triton reads this when kernels
# are decorated, so it is set here, before any test module (or vLLM, which the e2e modules
# import) imports triton. tests/e2e/conftest.py keeps it away from the vLLM servers they start.
if not _cuda_present():
    os.environ.setdefault("TRITON_INTERPRET", "1")

SCRIPTS = Path(__file__).resolve().parent.parent / "scripts"


def import_make_tiny_moe():
    """The scripts/make_tiny_moe.py module (scripts/ is not a package)."""
    import make_tiny_moe

    return make_tiny_moe


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory):
    """Factory `tiny_checkpoint(shape=None, dtype="bf16", seed=0, **options) -> Path`.

    Builds each distinct checkpoint once per session under a temporary directory;
    tests asking for the same one share it (treat it as read-only). `shape` is a
    TinyShape (None = the tiny-moe preset's shape); options are make_tiny_moe's
    keyword options (scale_dtype, shard_bytes, with_tokenizer).
    """
    tiny = import_make_tiny_moe()
    root = tmp_path_factory.mktemp("tiny-moe")
    made: dict[tuple, Path] = {}

    def make(shape=None, dtype: str = "bf16", seed: int = 0, **options) -> Path:
        shape = shape or tiny.TinyShape()
        key = (shape, dtype, seed, tuple(sorted(options.items())))
        if key not in made:
            made[key] = tiny.make_tiny_moe(root / f"ckpt{len(made)}", shape, dtype, seed, **options)
        return made[key]

    return make
