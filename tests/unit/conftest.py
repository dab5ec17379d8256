"""Unit tests run on the CPU: Triton kernels run in Triton's interpreter.

TRITON_INTERPRET is read when kernels (Triton's own library functions included)
are decorated, so it must be set before anything imports triton: here, before
any test module loads. An explicit value in the environment wins.
"""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")


import numpy as np  # noqa: E402
import pytest  # noqa: E402


@pytest.fixture(params=["reference", "host"])
def decode(request):
    """A CPU record decoder as a function (data, layout, geometry=STANDARD) -> raw record (np.uint8): the numpy
    reference, or the C decoder (built at first use) with its crc32 check on."""
    from bigmoe_pager.codec import format as F
    from bigmoe_pager.codec.reference import decode_record

    if request.param == "reference":
        return decode_record
    from bigmoe_pager.codec.host_decoder import HostDecoder

    def host(data, layout, geometry=F.STANDARD):
        out = np.full(layout.record_bytes, 0xA5, np.uint8)
        HostDecoder(layout, geometry).decode_into(np.frombuffer(bytes(data), np.uint8), layout, out)
        return out

    return host


@pytest.fixture
def bigmoe(capsys):
    """`bigmoe ARGS...` through its main, the one place errors become a line and an exit code: a function
    returning (exit code, stdout, stderr)."""
    from bigmoe.cli import main

    def run(*args: str) -> tuple[int, str, str]:
        try:
            main(list(args))
            code = 0
        except SystemExit as e:
            code = e.code or 0
        out = capsys.readouterr()
        return code, out.out, out.err

    return run
