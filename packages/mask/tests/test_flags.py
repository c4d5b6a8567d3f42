"""The strict parsers every package's env module hands its raw values to."""

from __future__ import annotations

import pytest
from magi_mask.flags import parse_positive_int


def test_parse_positive_int() -> None:
    assert parse_positive_int("X", None, 7) == 7
    assert parse_positive_int("X", "  ", 7) == 7
    assert parse_positive_int("X", " 12 ", 7) == 12
    assert parse_positive_int("X", "4", 64, minimum=4) == 4
    for raw in ("0", "-1", "1.5", "ten"):
        with pytest.raises(ValueError, match=r"X=.*positive integer \(default 7\)"):
            parse_positive_int("X", raw, 7)
    with pytest.raises(ValueError, match=r"Y='3' .*an integer >= 4 \(default 64\)"):
        parse_positive_int("Y", "3", 64, minimum=4)
