"""Old public names kept for one release (docs/migration.md): reading one warns, naming its replacement and
the release that removes it, and gives the new object itself."""

from __future__ import annotations

import pytest

import magi_ffa.testing as T


def test_random_slices_is_random_banded_slices() -> None:
    with pytest.warns(
        DeprecationWarning, match=r"removed in 0\.2\.0: use `magi_ffa\.testing\.random_banded_slices`"
    ):
        old = T.random_slices
    assert old is T.random_banded_slices


def test_from_import_of_an_old_name_warns() -> None:
    with pytest.warns(DeprecationWarning, match="random_banded_slices"):
        from magi_ffa.testing import random_slices
    assert random_slices is T.random_banded_slices


def test_other_missing_names_raise_attribute_error() -> None:
    with pytest.raises(AttributeError, match="no_such_helper"):
        _ = T.no_such_helper
    assert "random_slices" not in T.__all__
