"""Old public names kept for one release (docs/migration.md): they warn and are the new objects."""

from __future__ import annotations

import pytest

import magi_ffa.testing
import magi_ffa_fa4
import magi_ffa_fa4.testing


def test_clear_plan_cache_is_clear_launch_cache() -> None:
    with pytest.warns(DeprecationWarning, match=r"magi_ffa_fa4\.clear_launch_cache"):
        old = magi_ffa_fa4.clear_plan_cache
    assert old is magi_ffa_fa4.clear_launch_cache
    assert "clear_plan_cache" not in magi_ffa_fa4.__all__


def test_testing_random_slices_is_random_overlapping_slices() -> None:
    # this module's old name meant magi_ffa's random_overlapping_slices, not its banded generator
    with pytest.warns(DeprecationWarning, match=r"random_overlapping_slices"):
        old = magi_ffa_fa4.testing.random_slices
    assert old is magi_ffa_fa4.testing.random_overlapping_slices is magi_ffa.testing.random_overlapping_slices
