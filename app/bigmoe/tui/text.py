"""Text from outside (the vLLM log, a model's answer) made safe to draw: terminal escape sequences
and control characters would move the cursor or break an SVG screenshot."""

from __future__ import annotations

import re

ANSI_CSI = re.compile(r"\x1b\[[0-?]*[ -/]*[@-~]")
"""A terminal control sequence (colours, cursor moves), as vLLM's coloured logs may hold."""
CONTROL = re.compile(r"[\x00-\x08\x0b-\x1f\x7f-\x9f]")
"""Control characters other than newline and tab."""
REPLACEMENT = "\ufffd"


def printable(text: str) -> str:
    """`text` with escape sequences and carriage returns removed, tabs expanded, and any other
    control character shown as U+FFFD (so a random model's odd token stays visible)."""
    text = ANSI_CSI.sub("", text).replace("\r", "").expandtabs(4)
    return CONTROL.sub(REPLACEMENT, text)
