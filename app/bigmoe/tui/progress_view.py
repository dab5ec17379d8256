"""What the progress screen says about each step's event: one short line, and a fraction when one is known.
Pure functions of the (event, fields) pairs the pipeline reports."""

from __future__ import annotations

from bigmoe.units import size_text


def describe(event: str, fields: dict) -> str:
    """One line for a progress event of the model, fetch or prepare step."""
    state = fields.get("state") or fields.get("phase")
    if event == "model":
        if state == "making":
            return f"making {fields.get('name')} ({fields.get('dtype')}) on this machine"
        if state == "ready":
            return f"ready: {fields.get('path')}"
    if event == "fetch":
        if state == "planned":
            return f"{size_text(fields.get('bytes', 0), 2)} to download in {fields.get('files')} files"
        if state in ("download", "verify"):
            eta = fields.get("eta_s")
            speed = fields.get("speed_bps") or 0.0
            return (
                f"{state}: {fields.get('files_done')}/{fields.get('files_total')} files, "
                f"{size_text(fields.get('bytes_done', 0), 2)} of {size_text(fields.get('bytes_total', 0), 2)}, "
                f"{speed / 1e6:.1f} MB/s, ETA {'?' if eta is None else f'{eta:.0f} s'}"
            )
        if state == "ready":
            return "every file downloaded and verified"
    if event == "prepare":
        if state == "building" and "records_total" in fields:
            return (
                f"building the paging file: {fields['records_done']}/{fields['records_total']} records, "
                f"{fields.get('elapsed_s')} s"
            )
        if state == "building":
            return f"building the paging file {fields.get('path')} (compressed: {fields.get('compressed')})"
        if state == "built":
            return f"built {fields.get('path')} ({size_text(fields.get('bytes', 0), 2)} in {fields.get('seconds')} s)"
        if state == "reused":
            return f"reused {fields.get('path')} (its header matches this checkpoint)"
        if state == "not needed":
            return f"no paging file needed: {fields.get('why')}"
        if state in ("removed", "rebuilding"):
            return f"{state} {fields.get('path')}: {fields.get('reason')}"
    return " ".join(f"{k}={v}" for k, v in fields.items())


def fraction(event: str, fields: dict) -> tuple[float, float] | None:
    """(done, total) for a progress bar, when the event carries them."""
    for done, total in (("bytes_done", "bytes_total"), ("records_done", "records_total")):
        if isinstance(fields.get(total), (int, float)) and fields[total] > 0:
            return float(fields.get(done, 0)), float(fields[total])
    return None


def finished(event: str, fields: dict) -> bool:
    """Whether this event ends its step."""
    return (fields.get("state") or fields.get("phase")) in ("ready", "built", "reused", "not needed")
