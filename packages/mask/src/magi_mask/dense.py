"""The dense oracle: masks as numpy arrays straight from the type definitions (tests, small pictures).

Written from the definitions in `magi_mask.types`, not from the region algebra, so tests can check the
algebra (and every kernel) against it.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from .ranges import validate_slices
from .region import Region
from .types import CAUSAL_BIT, INV_CAUSAL_BIT, AttnMaskType

__all__ = ["dense_mask", "region_dense", "slice_dense"]


def slice_dense(sq: int, sk: int, attn_mask_type: Any) -> np.ndarray:
    """Bool `[sq, sk]`: one slice's mask in slice-local coordinates (local row i, local key j)."""
    t = AttnMaskType.from_any(attn_mask_type).code
    i = np.arange(sq)[:, None]
    j = np.arange(sk)[None, :]
    m = np.ones((sq, sk), dtype=bool)
    if t & CAUSAL_BIT:
        m &= j <= i + sk - sq  # bottom-right aligned
    if t & INV_CAUSAL_BIT:
        m &= j >= i  # top-left aligned
    return m


def dense_mask(
    q_ranges: Any, k_ranges: Any, attn_mask_type: Any, total_q: int, total_k: int, *, count: bool = False
) -> np.ndarray:
    """The mask `[total_q, total_k]`: bool (True = visible, the union of the slices), or with `count` the
    int64 number of slices covering each pair (a mask whose slices share no pair has 0/1 only).

    Takes ranges and types in every form `validate_slices` does; empty slices are allowed.
    """
    slices = validate_slices(q_ranges, k_ranges, attn_mask_type, total_q, total_k, allow_empty=True)
    out = np.zeros((total_q, total_k), dtype=np.int64)
    for qs, qe, ks, ke, t in slices:
        out[qs:qe, ks:ke] += slice_dense(qe - qs, ke - ks, t)
    return out if count else out > 0


def region_dense(r: Region, total_q: int, total_k: int) -> np.ndarray:
    """Bool `[total_q, total_k]` of a band region `(qs, qe, ks, ke, lo, hi)`."""
    qs, qe, ks, ke, lo, hi = r
    q = np.arange(total_q)[:, None]
    k = np.arange(total_k)[None, :]
    return (q >= qs) & (q < qe) & (k >= ks) & (k < ke) & (k - q >= lo) & (k - q <= hi)
