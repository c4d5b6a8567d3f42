"""The one mask-type enum: every accepted spelling, every rejected one, and the per-slice normalisation."""

from __future__ import annotations

import numpy as np
import pytest
from magi_mask import AttnMaskType, normalize_types


@pytest.mark.parametrize(
    "value", ["causal", "CAUSAL", " Causal ", 1, np.int32(1), AttnMaskType.CAUSAL], ids=repr
)
def test_from_any_and_call_accept_every_spelling(value: object) -> None:
    assert AttnMaskType.from_any(value) is AttnMaskType.CAUSAL
    assert AttnMaskType(value) is AttnMaskType.CAUSAL
    assert int(AttnMaskType(value)) == AttnMaskType.CAUSAL.code == 1


@pytest.mark.parametrize(
    ("value", "code"), [("inv-causal", 2), ("invcausal", 2), ("BI_CAUSAL", 3), ("bicausal", 3), (0, 0)]
)
def test_aliases(value: object, code: int) -> None:
    assert AttnMaskType.from_any(value).code == code


@pytest.mark.parametrize(
    ("value", "exc", "match"),
    [
        ("sliding", ValueError, "unknown mask type"),
        (4, ValueError, "int code"),
        (-1, ValueError, "int code"),
        (True, TypeError, "bool"),
        (1.0, TypeError, "attn_mask_type"),
        (None, TypeError, "attn_mask_type"),
    ],
)
def test_bad_values(value: object, exc: type[Exception], match: str) -> None:
    with pytest.raises(exc, match=match):
        AttnMaskType.from_any(value)
    with pytest.raises(ValueError):  # Enum's own constructor always raises ValueError
        AttnMaskType(value)


def test_bits() -> None:
    assert [t.is_causal for t in AttnMaskType] == [False, True, False, True]
    assert [t.is_inv_causal for t in AttnMaskType] == [False, False, True, True]
    assert [t.code for t in AttnMaskType] == [0, 1, 2, 3]


@pytest.mark.parametrize(
    ("types", "expected"),
    [
        pytest.param("causal", [1, 1], id="name-broadcast"),
        pytest.param(AttnMaskType.INV_CAUSAL, [2, 2], id="enum-broadcast"),
        pytest.param(3, [3, 3], id="int-broadcast"),
        pytest.param(np.int64(3), [3, 3], id="numpy-scalar"),
        pytest.param(["full", AttnMaskType.BI_CAUSAL], [0, 3], id="mixed-list"),
        pytest.param(np.array([1, 2]), [1, 2], id="array"),
    ],
)
def test_normalize_types(types: object, expected: list[int]) -> None:
    assert normalize_types(types, 2) == expected


def test_normalize_types_length() -> None:
    with pytest.raises(ValueError, match="3 entries but there are 2 slices"):
        normalize_types([0, 1, 2], 2)
    with pytest.raises(ValueError, match=r"attn_type_map\[1\]"):
        normalize_types([0, 9], 2, "attn_type_map")
