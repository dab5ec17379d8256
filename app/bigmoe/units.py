"""Byte sizes as people read them: every size the app prints goes through size_text."""

from __future__ import annotations

GIB = 1 << 30
MIB = 1 << 20
KIB = 1 << 10

_UNITS = (("GiB", GIB), ("MiB", MIB), ("KiB", KIB), ("B", 1))


def size_text(value: object, digits: int = 1, smallest: str = "GiB") -> str:
    """A byte count as "12.3 GiB", in the largest unit it reaches but never one below `smallest` (plain bytes
    print whole); a value that is not a number (an Unknown, a missing field) prints as its own text."""
    names = [unit for unit, _ in _UNITS]
    if smallest not in names:
        raise ValueError(f"unknown unit {smallest!r}; one of {', '.join(names)}")
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return str(value)
    for unit, scale in _UNITS:
        if value >= scale or unit == smallest:
            break
    return f"{value:.0f} B" if scale == 1 else f"{value / scale:.{digits}f} {unit}"
