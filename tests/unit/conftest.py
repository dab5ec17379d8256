"""Unit tests run on the CPU: Triton kernels run in Triton's interpreter.

TRITON_INTERPRET is read when kernels (Triton's own library functions included)
are decorated, so it must be set before anything imports triton: here, before
any test module loads. An explicit value in the environment wins.
"""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")
