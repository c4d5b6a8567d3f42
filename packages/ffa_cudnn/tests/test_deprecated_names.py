"""Old public names kept for one release (docs/migration.md): they warn and are the new objects."""

from __future__ import annotations

import magi_ffa_cudnn
import pytest


def test_clear_plan_cache_is_clear_mask_plan_cache() -> None:
    with pytest.warns(DeprecationWarning, match=r"magi_ffa_cudnn\.clear_mask_plan_cache"):
        old = magi_ffa_cudnn.clear_plan_cache
    assert old is magi_ffa_cudnn.clear_mask_plan_cache
    assert "clear_plan_cache" not in magi_ffa_cudnn.__all__
    with pytest.raises(AttributeError, match="no_such_name"):
        _ = magi_ffa_cudnn.no_such_name
