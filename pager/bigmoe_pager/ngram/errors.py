"""What can go wrong with an n-gram table, one class per kind of fault.

Every message is one line that names the file, tensor or id at fault and what
the reader expected, so a bad checkpoint stops the server at start-up with a
reason instead of serving wrong rows.
"""

from __future__ import annotations


class NgramError(RuntimeError):
    """Base class of every n-gram table error; the message is one line."""


class NgramFileError(NgramError):
    """A checkpoint file is missing, unreadable, not safetensors, or shorter than its header says."""


class NgramLayoutError(NgramError):
    """The shards do not form the table the model config describes (names, dtype, shapes, gaps)."""


class NgramRangeError(NgramError, IndexError):
    """A row id lies outside the table."""


class NgramReadError(NgramError):
    """A row read failed, came back short, or did not finish in time (after retries)."""
