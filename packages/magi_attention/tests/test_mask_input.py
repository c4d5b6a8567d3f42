"""Mask arguments in every accepted form normalise to the same key fields."""

from __future__ import annotations

import pytest
import torch

from magi_attention._runtime.mask_input import normalize_mask_types, normalize_ranges
from magi_solver import AttnMaskType, AttnRanges

PAIRS = ((0, 4), (4, 10))


@pytest.mark.parametrize(
    "ranges",
    [
        pytest.param([[0, 4], [4, 10]], id="lists"),
        pytest.param(((0, 4), (4, 10)), id="tuples"),
        pytest.param(AttnRanges.from_ranges([[0, 4], [4, 10]]), id="AttnRanges"),
        pytest.param(torch.tensor([[0, 4], [4, 10]], dtype=torch.int32), id="int32-tensor"),
        pytest.param(torch.tensor([[0, 4], [4, 10]]), id="int64-tensor"),
    ],
)
def test_ranges_forms(ranges) -> None:
    assert normalize_ranges(ranges, "q_ranges") == PAIRS


@pytest.mark.parametrize(
    ("types", "expected"),
    [
        pytest.param("causal", (1, 1), id="name-broadcast"),
        pytest.param(AttnMaskType.INV_CAUSAL, (2, 2), id="enum-broadcast"),
        pytest.param(3, (3, 3), id="int-broadcast"),
        pytest.param(["full", AttnMaskType.BI_CAUSAL], (0, 3), id="mixed-list"),
        pytest.param(torch.tensor([1, 2], dtype=torch.int32), (1, 2), id="tensor"),
    ],
)
def test_mask_type_forms(types, expected) -> None:
    assert normalize_mask_types(types, 2) == expected


@pytest.mark.parametrize(
    ("ranges", "error", "match"),
    [
        pytest.param(torch.zeros(2, 2), TypeError, "integer tensor", id="float-tensor"),
        pytest.param(torch.zeros(2, 3, dtype=torch.int32), ValueError, r"\[n, 2\]", id="bad-shape"),
        pytest.param([[0, 1, 2]], ValueError, r"q_ranges\[0\]", id="triple"),
        pytest.param("0-4", TypeError, "list of", id="string"),
    ],
)
def test_bad_ranges(ranges, error, match) -> None:
    with pytest.raises(error, match=match):
        normalize_ranges(ranges, "q_ranges")


@pytest.mark.parametrize(
    ("types", "error", "match"),
    [
        pytest.param("diagonal", ValueError, "unknown mask type", id="unknown-name"),
        pytest.param(7, ValueError, "int code", id="bad-code"),
        pytest.param([0, 1, 2], ValueError, "3 entries but there are 2 slices", id="wrong-length"),
        pytest.param(True, TypeError, "bool", id="bool"),
    ],
)
def test_bad_mask_types(types, error, match) -> None:
    with pytest.raises(error, match=match):
        normalize_mask_types(types, 2)
