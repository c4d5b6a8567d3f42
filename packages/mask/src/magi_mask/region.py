"""Band regions: the algebra every slice operation (clip, subtract, union, area) is done in.

A band region `(qs, qe, ks, ke, lo, hi)` is the rectangle `[qs, qe) x [ks, ke)` intersected with the
diagonal band `lo <= k - q <= hi` (global coordinates). Every typed slice is one (`region_of`); clipping a
region to a q- or k-interval keeps it a band region, and `decompose_region` turns any band region back into
at most three disjoint typed slices. A bound that cuts nothing is stored as its "inactive" value
(`lo = ks - qe + 1`, `hi = ke - 1 - qs`), so no sentinel infinities appear.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import Any

import numpy as np

from .ranges import TypedSlice
from .types import BI_CAUSAL, CAUSAL, CAUSAL_BIT, FULL, INV_CAUSAL, INV_CAUSAL_BIT

__all__ = [
    "Region",
    "any_shared_pair",
    "band_area",
    "band_area_np",
    "clip_region",
    "decompose_region",
    "disjoint_regions",
    "disjoint_union",
    "intersect_regions",
    "region_bounds_active",
    "region_of",
    "slice_area",
    "subtract_region",
    "tighten_region",
    "total_area",
]

Region = tuple[int, int, int, int, int, int]  # (qs, qe, ks, ke, lo, hi): half-open rows/cols, closed band


def region_of(qs: int, qe: int, ks: int, ke: int, t: int) -> Region:
    """The band region of the typed slice `([qs, qe), [ks, ke), t)` (`t` an int code)."""
    lo = ks - qs if t & INV_CAUSAL_BIT else ks - qe + 1  # INV_CAUSAL / BI_CAUSAL bound the band from below
    hi = ke - qe if t & CAUSAL_BIT else ke - 1 - qs  # CAUSAL / BI_CAUSAL bound it from above
    return (qs, qe, ks, ke, lo, hi)


def tighten_region(qs: int, qe: int, ks: int, ke: int, lo: int, hi: int) -> Region | None:
    """Shrink the rectangle to the rows and columns that hold at least one pair; None when empty.

    The region is non-empty iff the rectangle is and the band `[lo, hi]` meets the rectangle's range of
    `k - q`, which is `[ks - qe + 1, ke - 1 - qs]` (every integer in it is attained). After one pass of
    rows then columns every row and column of the result holds a pair.
    """
    if qs >= qe or ks >= ke:
        return None
    lo = max(lo, ks - qe + 1)
    hi = min(hi, ke - 1 - qs)
    if lo > hi:
        return None
    qs, qe = max(qs, ks - hi), min(qe, ke - lo)
    ks, ke = max(ks, qs + lo), min(ke, qe + hi)
    return (qs, qe, ks, ke, max(lo, ks - qe + 1), min(hi, ke - 1 - qs))


def region_bounds_active(r: Region) -> tuple[bool, bool]:
    """`(causal, inv_causal)`: whether the band's upper / lower edge cuts the (tightened) rectangle."""
    qs, qe, ks, ke, lo, hi = r
    return hi < ke - 1 - qs, lo > ks - qe + 1


def clip_region(r: Region, q0: int, q1: int, k0: int, k1: int) -> Region | None:
    """Region `r` restricted to rows `[q0, q1)` and columns `[k0, k1)`, tightened (None when empty)."""
    return tighten_region(max(r[0], q0), min(r[1], q1), max(r[2], k0), min(r[3], k1), r[4], r[5])


def intersect_regions(a: Region, b: Region) -> Region | None:
    """The pairs in both regions, tightened (None when they share none)."""
    return tighten_region(
        max(a[0], b[0]), min(a[1], b[1]), max(a[2], b[2]), min(a[3], b[3]), max(a[4], b[4]), min(a[5], b[5])
    )


def subtract_region(p: Region, s: Region) -> list[Region]:
    """Disjoint regions whose union is `p` minus `s`: at most six (rows above / below `s`, shared rows with
    columns left / right of `s`, and the shared rectangle's diagonals below / above `s`'s band)."""
    if intersect_regions(p, s) is None:
        return [p]
    qs, qe, ks, ke, lo, hi = p
    mq0, mq1 = max(qs, s[0]), min(qe, s[1])  # rows both span
    mk0, mk1 = max(ks, s[2]), min(ke, s[3])  # columns both span
    pieces = (
        tighten_region(qs, min(qe, s[0]), ks, ke, lo, hi),
        tighten_region(max(qs, s[1]), qe, ks, ke, lo, hi),
        tighten_region(mq0, mq1, ks, min(ke, s[2]), lo, hi),
        tighten_region(mq0, mq1, max(ks, s[3]), ke, lo, hi),
        tighten_region(mq0, mq1, mk0, mk1, lo, min(hi, s[4] - 1)),
        tighten_region(mq0, mq1, mk0, mk1, max(lo, s[5] + 1), hi),
    )
    return [r for r in pieces if r is not None]


def decompose_region(r: Region) -> list[TypedSlice]:
    """Disjoint typed slices whose union is the tightened region `r` (at most three).

    Cases: no active bound -> FULL; only `hi` -> CAUSAL, plus FULL rows below once the band leaves the
    rectangle; only `lo` -> INV_CAUSAL, plus FULL rows above; both -> BI_CAUSAL after cutting off the rows
    where one bound is inactive.
    """
    qs, qe, ks, ke, lo, hi = r
    hi_act, lo_act = region_bounds_active(r)
    if not lo_act and not hi_act:
        return [(qs, qe, ks, ke, FULL)]
    cuts = []
    if lo_act and ks > qs + lo:
        cuts.append(ks - lo)  # rows above ks - lo see every key from ks on: lo does not cut them
    if hi_act and ke < qe + hi:
        cuts.append(ke - hi)  # rows from ke - hi on see every key up to ke - 1: hi does not cut them
    if not cuts:
        t = (CAUSAL if hi_act else FULL) | (INV_CAUSAL if lo_act else FULL)
        assert t in (CAUSAL, INV_CAUSAL, BI_CAUSAL), f"region {r} has an active bound but type {t}"
        return [(qs, qe, ks, ke, t)]
    out: list[TypedSlice] = []
    for a, b in itertools.pairwise([qs, *sorted(set(cuts)), qe]):
        sub = tighten_region(a, b, ks, ke, lo, hi)
        if sub is not None:
            out.extend(decompose_region(sub))
    return out


def any_shared_pair(regs: Sequence[Region]) -> bool:
    """Whether two of the regions share a (q, k) pair: a sweep over q that compares each region with the
    earlier ones whose rows it meets (vectorised once more than 32 are active)."""
    arr = np.asarray(regs, dtype=np.int64).reshape(-1, 6)
    order = sorted(range(len(regs)), key=lambda i: regs[i][0])
    active: list[int] = []
    for i in order:
        qs_i, qe_i, ks_i, ke_i, lo_i, hi_i = regs[i]
        active = [j for j in active if regs[j][1] > qs_i]
        if len(active) > 32:
            r = arr[np.asarray(active)]
            b = np.minimum(qe_i, r[:, 1])
            c, e = np.maximum(ks_i, r[:, 2]), np.minimum(ke_i, r[:, 3])
            d = np.maximum(np.maximum(lo_i, r[:, 4]), c - b + 1)
            if ((c < e) & (d <= np.minimum(np.minimum(hi_i, r[:, 5]), e - 1 - qs_i))).any():
                return True
        elif any(intersect_regions(regs[i], regs[j]) is not None for j in active):
            return True
        active.append(i)
    return False


def disjoint_regions(regs: Sequence[Region]) -> list[Region] | None:
    """None when no two regions share a pair; else tightened regions, pairwise disjoint, with the same union.

    Earlier regions win: the pairs a region shares with earlier ones are cut out of it, so the first
    regions' order is kept (consumers that accumulate in slice order see the same order).
    """
    if not any_shared_pair(regs):
        return None
    kept: list[Region] = []
    for r in regs:
        pieces = [t for t in (tighten_region(*r),) if t is not None]
        for s in kept:
            if s[0] >= r[1] or s[1] <= r[0] or s[2] >= r[3] or s[3] <= r[2]:
                continue  # bounding boxes apart
            pieces = [piece for p in pieces for piece in subtract_region(p, s)]
            if not pieces:
                break
        kept.extend(pieces)
    return kept


def disjoint_union(slices: list[TypedSlice]) -> list[TypedSlice]:
    """`slices` unchanged when no two share a (q, k) pair; else disjoint typed slices with the same union.

    The mask is the union of its slices, but every consumer (areas, dispatch, the kernels) adds slices up,
    so shared pairs are cut out of later slices once, here, and each piece is re-expressed in the four
    types by `decompose_region`.
    """
    kept = disjoint_regions([region_of(*s) for s in slices])
    if kept is None:
        return slices
    return [ts for r in kept for ts in decompose_region(r)]


# -- exact areas --------------------------------------------------------------------------------------------
def _c_sum(v: int, w: int) -> int:
    # sum_{u=1..v} clamp(u, 0, w), zero for v <= 0
    if v <= 0 or w <= 0:
        return 0
    if v <= w:
        return v * (v + 1) // 2
    return w * (w + 1) // 2 + (v - w) * w


def band_area(qs: int, qe: int, ks: int, ke: int, lo: int, hi: int) -> int:
    """Exact number of pairs `(q, k)` in `[qs, qe) x [ks, ke)` with `lo <= k - q <= hi` (any bounds)."""
    if qs >= qe or ks >= ke or lo > hi:
        return 0
    w = ke - ks

    def below(t: int) -> int:  # pairs with k - q <= t
        return _c_sum(qe + t - ks, w) - _c_sum(qs + t - ks, w)

    return below(hi) - below(lo - 1)


def _c_sum_np(v: np.ndarray, w: np.ndarray) -> np.ndarray:
    v = np.maximum(v, 0)
    small = v * (v + 1) // 2
    big = w * (w + 1) // 2 + (v - w) * w
    return np.where(v <= w, small, big)


def band_area_np(qs: Any, qe: Any, ks: Any, ke: Any, lo: Any, hi: Any) -> np.ndarray:
    """Vectorised `band_area` over int64 arrays (broadcasting)."""
    qs, qe, ks, ke, lo, hi = (np.asarray(x, dtype=np.int64) for x in (qs, qe, ks, ke, lo, hi))
    qe = np.maximum(qe, qs)
    w = np.maximum(ke - ks, 0)
    hi_eff = np.maximum(hi, lo - 1)  # lo > hi means empty: makes the difference below zero

    def below(t: np.ndarray) -> np.ndarray:
        return _c_sum_np(qe + t - ks, w) - _c_sum_np(qs + t - ks, w)

    return below(hi_eff) - below(lo - 1)


def slice_area(qs: int, qe: int, ks: int, ke: int, t: int) -> int:
    """Exact number of pairs of the typed slice."""
    return band_area(*region_of(qs, qe, ks, ke, t))


def total_area(slices: Sequence[TypedSlice]) -> int:
    """Sum of the exact areas of typed slices (vectorised)."""
    if not slices:
        return 0
    a = np.asarray(slices, dtype=np.int64)
    qs, qe, ks, ke, t = (a[:, i] for i in range(5))
    lo = np.where(t & INV_CAUSAL_BIT, ks - qs, ks - qe + 1)
    hi = np.where(t & CAUSAL_BIT, ke - qe, ke - 1 - qs)
    return int(band_area_np(qs, qe, ks, ke, lo, hi).sum())
