"""Union semantics for slices that share (query, key) pairs.

The kernels add up slices, so a pair covered by two slices would count twice. The mask is defined as the
*union* of the slices, so before any kernel runs, overlapping slices are rewritten (on the host, once per
mask: the caller caches by value) into slices that share no pair and cover the same union. The rewrite is
``magi_mask.disjoint_regions``, the band-region algebra every package shares; a band region maps onto a
kernel ``Slice`` one to one (its band bounds are the slice's diagonal offsets), so no dense mask is built.
"""

from __future__ import annotations

from magi_mask import AttnMaskType, Region, disjoint_regions, region_bounds_active, tighten_region

from ._slice import Slice


def _region(s: Slice) -> Region:
    lo = s.dk_inv if s.is_inv_causal else s.k_start - s.q_end + 1
    hi = s.dk if s.is_causal else s.k_end - 1 - s.q_start
    r = tighten_region(s.q_start, s.q_end, s.k_start, s.k_end, lo, hi)
    assert r is not None, f"trimmed slice {s} must be non-empty"
    return r


def _to_slice(r: Region) -> Slice:
    qs, qe, ks, ke, lo, hi = r
    causal, inv = region_bounds_active(r)  # which band edges cut the rectangle
    attn_type = AttnMaskType.from_code((1 if causal else 0) | (2 if inv else 0))
    return Slice(qs, qe, ks, ke, attn_type, dk=hi, dk_inv=lo)


def disjoint_slices(slices: tuple[Slice, ...]) -> tuple[Slice, ...]:
    """``slices`` unchanged when no two share a pair; otherwise slices covering the same union, pairwise disjoint.

    Slice order is kept where slices are already disjoint (the kernels accumulate in slice order).
    """
    kept = disjoint_regions([_region(s) for s in slices])
    return slices if kept is None else tuple(_to_slice(r) for r in kept)
