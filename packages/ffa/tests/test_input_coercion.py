"""Inputs that used to be coerced silently (truncated, wrapped, or turned every output into NaN) raise,
naming the argument."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import magi_ffa

Q = torch.randn(16, 2, 16, dtype=torch.float64)
K = torch.randn(16, 2, 16, dtype=torch.float64)
V = torch.randn(16, 2, 16, dtype=torch.float64)
OK = {"q_ranges": [[0, 8]], "k_ranges": [[0, 8]], "attn_type_map": None}


@pytest.mark.parametrize(
    ("override", "exc", "words"),
    [
        ({"q_ranges": [[0.0, 8.7]]}, TypeError, "q_ranges"),
        ({"q_ranges": np.array([[0.0, 8.0]])}, TypeError, "q_ranges"),
        ({"q_ranges": torch.tensor([[0.0, 8.7]])}, ValueError, "q_ranges"),
        ({"q_ranges": torch.tensor([[0, 2**32 + 8]])}, ValueError, "q_ranges.*int32"),
        ({"k_ranges": torch.tensor([[-(2**32), 8]])}, ValueError, "k_ranges.*int32"),
        ({"attn_type_map": [1.7]}, TypeError, "attn_type_map"),
        ({"attn_type_map": 1.7}, TypeError, "attn_type_map"),
        ({"attn_type_map": torch.tensor([1.7])}, ValueError, "attn_type_map"),
        ({"attn_type_map": torch.tensor([2**32 + 1])}, ValueError, "attn_type_map.*int32"),
        ({"softmax_scale": True}, ValueError, "softmax_scale"),
        ({"softmax_scale": float("inf")}, ValueError, "softmax_scale"),
        ({"softmax_scale": float("nan")}, ValueError, "softmax_scale"),
        ({"softmax_scale": 1e300}, ValueError, "softmax_scale"),
        ({"softcap": float("inf")}, ValueError, "softcap"),
        ({"softcap": float("nan")}, ValueError, "softcap"),
        ({"softcap": True}, ValueError, "softcap"),
    ],
)
def test_coercions_are_rejected(override, exc, words):
    with pytest.raises(exc, match=words):
        magi_ffa.flex_flash_attn_func(Q, K, V, **{**OK, **override})


def test_int64_ranges_within_int32_still_work():
    out, _ = magi_ffa.flex_flash_attn_func(
        Q, K, V, torch.tensor([[0, 8]]), torch.tensor([[0, 8]]), torch.tensor([1])
    )
    ref, _ = magi_ffa.flex_flash_attn_func(Q, K, V, [[0, 8]], [[0, 8]], "causal")
    assert torch.equal(out, ref) and torch.isfinite(out).all()


def test_dlse_must_match_lse() -> None:
    import pytest
    import torch

    from magi_ffa.validation import validate_dlse

    lse = torch.zeros(4, 2)
    validate_dlse(None, lse)
    validate_dlse(torch.ones(4, 2), lse)
    for bad in (torch.ones(2, 4), "x", torch.ones(4, 2, 1)):
        with pytest.raises(ValueError, match="`dlse`"):
            validate_dlse(bad, lse)


def test_host_tables_stay_on_the_host() -> None:
    """A CPU range or type table is never moved to q's device: every entry reads the slices on the host, and
    a move there and back would make each call wait for the kernels queued before it. (``meta`` stands in
    for a GPU on a machine without one.)"""
    from magi_ffa._common import as_ranges, as_type_map

    meta = torch.device("meta")
    for x in (torch.tensor([1, 0]), torch.tensor([1, 0], dtype=torch.int32), [1, 0], None):
        t = as_type_map(x, 2, meta)
        assert t.device.type == "cpu" and t.dtype == torch.int32, x
    r = as_ranges(torch.tensor([[0, 8]]), "q_ranges", meta)
    assert r.device.type == "cpu" and r.dtype == torch.int32
