"""Union semantics for slices that share (query, key) pairs.

The kernels add up slices, so a pair covered by two slices would count twice. The mask is defined as the
*union* of the slices, so before any kernel runs, overlapping slices are rewritten (on the host, once per
mask: the caller caches by value) into slices that share no pair and cover the same union.

Every slice is a band region: rows ``[qs, qe)``, columns ``[ks, ke)`` and diagonals ``lo <= k - q <= hi``.
Region minus region is a union of at most six regions (rows above, rows below, columns left, columns right,
diagonals below, diagonals above), so the rewrite stays in the slice algebra and never builds a dense mask.
magi_solver has the same algebra (it cannot be imported here: the kernel package stays independent).
"""

from __future__ import annotations

from ._common import AttnType, Slice

Region = tuple[int, int, int, int, int, int]  # qs, qe, ks, ke, lo, hi (half-open rows/cols, closed band)


def _tighten(qs: int, qe: int, ks: int, ke: int, lo: int, hi: int) -> Region | None:
    """Shrink to the rows/columns holding a pair; None when the region is empty."""
    if qs >= qe or ks >= ke:
        return None
    lo, hi = max(lo, ks - qe + 1), min(hi, ke - 1 - qs)
    if lo > hi:
        return None
    qs, qe = max(qs, ks - hi), min(qe, ke - lo)
    ks, ke = max(ks, qs + lo), min(ke, qe + hi)
    return (qs, qe, ks, ke, max(lo, ks - qe + 1), min(hi, ke - 1 - qs))


def _region(s: Slice) -> Region:
    lo = s.dk_inv if s.is_inv_causal else s.k_start - s.q_end + 1
    hi = s.dk if s.is_causal else s.k_end - 1 - s.q_start
    r = _tighten(s.q_start, s.q_end, s.k_start, s.k_end, lo, hi)
    assert r is not None, f"trimmed slice {s} must be non-empty"
    return r


def _to_slice(r: Region) -> Slice:
    qs, qe, ks, ke, lo, hi = r
    causal = hi < ke - 1 - qs  # the band's upper edge cuts the rectangle
    inv = lo > ks - qe + 1  # its lower edge does
    attn_type = AttnType((1 if causal else 0) | (2 if inv else 0))
    return Slice(qs, qe, ks, ke, attn_type, dk=hi, dk_inv=lo)


def _intersect(a: Region, b: Region) -> Region | None:
    return _tighten(
        max(a[0], b[0]), min(a[1], b[1]), max(a[2], b[2]), min(a[3], b[3]), max(a[4], b[4]), min(a[5], b[5])
    )


def _subtract(p: Region, s: Region) -> list[Region]:
    """Disjoint regions whose union is ``p`` minus ``s``."""
    if _intersect(p, s) is None:
        return [p]
    qs, qe, ks, ke, lo, hi = p
    mq0, mq1 = max(qs, s[0]), min(qe, s[1])  # rows both span
    mk0, mk1 = max(ks, s[2]), min(ke, s[3])  # columns both span
    pieces = [
        _tighten(qs, min(qe, s[0]), ks, ke, lo, hi),  # rows above s
        _tighten(max(qs, s[1]), qe, ks, ke, lo, hi),  # rows below s
        _tighten(mq0, mq1, ks, min(ke, s[2]), lo, hi),  # shared rows, columns left of s
        _tighten(mq0, mq1, max(ks, s[3]), ke, lo, hi),  # shared rows, columns right of s
        _tighten(mq0, mq1, mk0, mk1, lo, min(hi, s[4] - 1)),  # shared rectangle, diagonals below s's band
        _tighten(mq0, mq1, mk0, mk1, max(lo, s[5] + 1), hi),  # shared rectangle, diagonals above s's band
    ]
    return [r for r in pieces if r is not None]


def disjoint_slices(slices: tuple[Slice, ...]) -> tuple[Slice, ...]:
    """``slices`` unchanged when no two share a pair; otherwise slices covering the same union, pairwise disjoint.

    Slice order is kept where slices are already disjoint (the kernels accumulate in slice order).
    """
    regions = [_region(s) for s in slices]
    if not _any_shared_pair(regions):
        return slices
    kept: list[Region] = []
    for r in regions:
        pieces = [r]
        for s in kept:
            if s[0] >= r[1] or s[1] <= r[0] or s[2] >= r[3] or s[3] <= r[2]:
                continue  # bounding boxes apart
            pieces = [piece for p in pieces for piece in _subtract(p, s)]
            if not pieces:
                break
        kept.extend(pieces)
    return tuple(_to_slice(r) for r in kept)


def _any_shared_pair(regions: list[Region]) -> bool:
    """Sweep over rows: compare each region with the earlier ones whose rows it meets."""
    order = sorted(range(len(regions)), key=lambda i: regions[i][0])
    active: list[Region] = []
    for i in order:
        r = regions[i]
        active = [a for a in active if a[1] > r[0]]
        if any(_intersect(a, r) is not None for a in active):
            return True
        active.append(r)
    return False
