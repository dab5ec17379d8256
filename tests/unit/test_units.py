"""size_text: the one byte-size formatter every printed size goes through."""

from __future__ import annotations

import pytest
from bigmoe.machine.hardware import Unknown
from bigmoe.units import GIB, KIB, MIB, size_text


@pytest.mark.parametrize(
    ("value", "kwargs", "text"),
    [
        (3 * GIB, {}, "3.0 GiB"),
        (GIB // 4, {}, "0.2 GiB"),  # GiB is the smallest unit unless told otherwise
        (3 * GIB, {"digits": 2}, "3.00 GiB"),
        (1.5 * GIB, {"digits": 2}, "1.50 GiB"),
        (-GIB // 2, {}, "-0.5 GiB"),  # a shortfall prints signed
        (3 * GIB, {"smallest": "MiB"}, "3.0 GiB"),
        (5 * MIB, {"digits": 2, "smallest": "MiB"}, "5.00 MiB"),
        (KIB, {"smallest": "MiB"}, "0.0 MiB"),
        (3 * KIB, {"digits": 2, "smallest": "B"}, "3.00 KiB"),
        (17, {"digits": 2, "smallest": "B"}, "17 B"),
    ],
)
def test_sizes(value, kwargs, text):
    assert size_text(value, **kwargs) == text


@pytest.mark.parametrize("value", [Unknown("no nvidia-smi"), None, "?", True])
def test_non_numbers_print_as_themselves(value):
    assert size_text(value) == str(value)


def test_unknown_unit_is_refused():
    with pytest.raises(ValueError, match="unknown unit 'TiB'"):
        size_text(5, smallest="TiB")
