"""magi_ffa.testing.split_keys_into_stages: the helper the GPU tests of every backend split keys with."""

from __future__ import annotations

import pytest

from magi_ffa.testing import split_keys_into_stages


def test_full_slices_are_cut_and_others_stay_whole() -> None:
    st = split_keys_into_stages([[0, 10], [0, 10]], [[0, 50], [60, 70]], [0, 1], [0, 30, 70])
    assert st[0] == ([[0, 10]], [[0, 30]], [0])
    assert st[1] == ([[0, 10], [0, 10]], [[0, 20], [30, 40]], [0, 1])
    with pytest.raises(ValueError, match="FULL"):
        split_keys_into_stages([[0, 10]], [[20, 40]], [1], [0, 30, 70])
