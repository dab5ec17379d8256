"""The synthetic models a preset can name (tiny-moe): made on this machine on first use, then cached."""

from __future__ import annotations

from pathlib import Path

from bigmoe.errors import BigmoeError
from bigmoe.model.presets import Preset
from bigmoe.paths import models_dir


class SyntheticModelError(BigmoeError):
    """The synthetic checkpoint could not be made."""


def tiny_model_path(preset: Preset, dtype: str) -> Path:
    return models_dir() / f"{preset.name}-{dtype}"


def ensure_tiny_model(preset: Preset, dtype: str, seed: int = 0) -> Path:
    """The checkpoint for a synthetic preset, made once (atomically) and reused after."""
    from bigmoe.model.tinymoe.make import TinyShape, make_tiny_moe

    arch = preset.arch
    shape = TinyShape(
        layers=arch.moe_layers,
        experts=arch.experts,
        top_k=arch.top_k,
        hidden=arch.hidden,
        moe_intermediate=arch.moe_intermediate,
        vocab=arch.vocab,
    )
    try:
        return make_tiny_moe(tiny_model_path(preset, dtype), shape, dtype, seed)
    except (ValueError, OSError, RuntimeError) as e:
        raise SyntheticModelError(f"cannot make the {preset.name} checkpoint: {e}") from None
