"""obtain: the checkpoint directory to serve: the one given (--model-dir), made on this machine (synthetic
presets), or fetched from the Hub; checked against the preset before anything reads it."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Callable

from bigmoe.errors import BigmoeError
from bigmoe.model import presets

Progress = Callable[[str, dict], None]
"""Called with (event, fields) as the model is made or fetched."""


def obtain(preset: presets.Preset, dtype: str, model_dir: str | None, say: Progress) -> Path:
    """The checkpoint directory for `preset` in expert `dtype` (the plan's), checked against the preset."""
    path = _locate(preset, dtype, model_dir, say)
    presets.check_config(preset, path)
    return path


def _locate(preset: presets.Preset, dtype: str, model_dir: str | None, say: Progress) -> Path:
    if model_dir:
        path = Path(model_dir).expanduser()
        if not (path / "config.json").is_file() or not os.access(path / "config.json", os.R_OK):
            raise BigmoeError(f"--model-dir {path}: no readable config.json there")
        return path
    if preset.synthetic:
        from bigmoe.model.synthetic import ensure_tiny_model

        say("model", {"state": "making", "name": preset.name, "dtype": dtype})
        return ensure_tiny_model(preset, dtype)
    from bigmoe.model import fetch

    fetch_plan = fetch.dry_run(preset.hub_id, preset.revision)
    say("fetch", {"state": "planned", "bytes": fetch_plan.bytes_to_download, "files": len(fetch_plan.files)})
    return fetch.fetch(
        fetch_plan, lambda p: say("fetch", p.__dict__ if hasattr(p, "__dict__") else {"progress": str(p)})
    )
