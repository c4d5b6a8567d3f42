"""Mask algebra: the four slice types, exact areas, and clipping that stays inside the four types.

A mask over `[total_q] x [total_k]` is the union of slices `(q_range, k_range, type)`. Inside one slice,
with `sq = |q_range|`, `sk = |k_range|`, local row `i` and local column `j`:

```
FULL        all pairs                      CAUSAL (bottom-right)   INV_CAUSAL (top-left)   BI_CAUSAL (both)
sq=3, sk=5: 1 1 1 1 1                      1 1 1 0 0               1 1 1 1 1               1 1 1 0 0
            1 1 1 1 1                      1 1 1 1 0               0 1 1 1 1               0 1 1 1 0
            1 1 1 1 1                      1 1 1 1 1               0 0 1 1 1               0 0 1 1 1
```
CAUSAL keeps `j <= i + sk - sq`, INV_CAUSAL keeps `j >= i`, BI_CAUSAL keeps both.

Internally every slice is a *band region*: the rectangle `[qs, qe) x [ks, ke)` intersected with the
diagonal band `lo <= k - q <= hi` (global coordinates). Clipping a region to a q- or k-interval keeps it
a band region; `decompose` turns any band region back into at most three disjoint typed slices. A bound
that cuts nothing is stored as its "inactive" value (`lo = ks - qe + 1`, `hi = ke - 1 - qs`), so no
sentinel infinities appear.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

import numpy as np

from .ranges import AttnRange, as_int_pairs

__all__ = [
    "AttnMaskType",
    "AttnSlice",
    "SliceList",
    "band_area",
    "band_area_np",
    "decompose_region",
    "normalize_mask",
    "region_of",
    "tighten_region",
]

Region = tuple[int, int, int, int, int, int]  # (qs, qe, ks, ke, lo, hi)
TypedSlice = tuple[int, int, int, int, int]  # (qs, qe, ks, ke, type code)

FULL, CAUSAL, INV_CAUSAL, BI_CAUSAL = 0, 1, 2, 3


class AttnMaskType(StrEnum):
    """The four slice types. `.code` is the int the kernels take (FULL=0, CAUSAL=1, INV_CAUSAL=2, BI_CAUSAL=3)."""

    FULL = "full"
    CAUSAL = "causal"
    INV_CAUSAL = "inv_causal"
    BI_CAUSAL = "bi_causal"

    @property
    def code(self) -> int:
        return _CODES[self]

    def to_int_type(self) -> int:
        return _CODES[self]

    def __int__(self) -> int:
        return _CODES[self]

    @classmethod
    def from_any(cls, value: Any, name: str = "attn_mask_type") -> AttnMaskType:
        """Accept an `AttnMaskType`, its name/value (any case, e.g. "causal", "CAUSAL") or its int code 0-3."""
        if isinstance(value, cls):
            return value
        if isinstance(value, str):
            key = value.strip().lower()
            for t in cls:
                if key in (t.value, t.name.lower()):
                    return t
            raise ValueError(f"`{name}` must be one of {[t.value for t in cls]} or 0-3, got {value!r}")
        if isinstance(value, bool) or not hasattr(value, "__index__"):
            raise TypeError(f"`{name}` must be an AttnMaskType, a name or an int code 0-3, got {value!r}")
        code = int(value.__index__())
        if not 0 <= code <= 3:
            raise ValueError(
                f"`{name}` int code must be 0-3 (FULL, CAUSAL, INV_CAUSAL, BI_CAUSAL), got {code}"
            )
        return _BY_CODE[code]

    @classmethod
    def from_code(cls, code: int) -> AttnMaskType:
        return cls.from_any(code)


_CODES = {AttnMaskType.FULL: 0, AttnMaskType.CAUSAL: 1, AttnMaskType.INV_CAUSAL: 2, AttnMaskType.BI_CAUSAL: 3}
_BY_CODE = {v: k for k, v in _CODES.items()}


# -- band regions ---------------------------------------------------------------------------------------
def region_of(qs: int, qe: int, ks: int, ke: int, t: int) -> Region:
    """The band region of the typed slice `([qs, qe), [ks, ke), t)`."""
    lo = ks - qs if t & 2 else ks - qe + 1  # INV_CAUSAL / BI_CAUSAL bound the diagonal from below
    hi = ke - qe if t & 1 else ke - 1 - qs  # CAUSAL / BI_CAUSAL bound it from above
    return (qs, qe, ks, ke, lo, hi)


def tighten_region(qs: int, qe: int, ks: int, ke: int, lo: int, hi: int) -> Region | None:
    """Shrink the rectangle to the rows and columns that hold at least one pair; None when empty.

    The region is non-empty iff the rectangle is and the band `[lo, hi]` meets the rectangle's range of
    `k - q`, which is `[ks - qe + 1, ke - 1 - qs]` (every integer in it is attained). After one pass of
    rows then columns every row and column of the result holds a pair (so the k extent is exactly the
    set of keys the rows need).
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


def clip_region(r: Region, q0: int, q1: int, k0: int, k1: int) -> Region | None:
    """Region `r` restricted to rows `[q0, q1)` and columns `[k0, k1)`, tightened (None when empty)."""
    return tighten_region(max(r[0], q0), min(r[1], q1), max(r[2], k0), min(r[3], k1), r[4], r[5])


def decompose_region(r: Region) -> list[TypedSlice]:
    """Disjoint typed slices whose union is the tightened region `r` (at most three).

    Cases: no active bound -> FULL; only `hi` -> CAUSAL, plus FULL rows below once the band leaves the
    rectangle; only `lo` -> INV_CAUSAL, plus FULL rows above; both -> BI_CAUSAL after cutting off the rows
    where one bound is inactive.
    """
    qs, qe, ks, ke, lo, hi = r
    lo_act = lo > ks - qe + 1
    hi_act = hi < ke - 1 - qs
    if not lo_act and not hi_act:
        return [(qs, qe, ks, ke, FULL)]
    cuts = []
    if lo_act and ks > qs + lo:
        cuts.append(ks - lo)  # rows above ks - lo see every key from ks on: lo does not cut them
    if hi_act and ke < qe + hi:
        cuts.append(ke - hi)  # rows from ke - hi on see every key up to ke - 1: hi does not cut them
    if not cuts:
        t = (CAUSAL if hi_act else 0) | (INV_CAUSAL if lo_act else 0)
        return [(qs, qe, ks, ke, t)]
    out: list[TypedSlice] = []
    bounds = [qs, *sorted(set(cuts)), qe]
    for a, b in itertools.pairwise(bounds):
        sub = tighten_region(a, b, ks, ke, lo, hi)
        if sub is not None:
            out.extend(decompose_region(sub))
    return out


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
    return band_area(*region_of(qs, qe, ks, ke, t))


def total_area(slices: Sequence[TypedSlice]) -> int:
    """Sum of the exact areas of typed slices (vectorised)."""
    if not slices:
        return 0
    a = np.asarray(slices, dtype=np.int64)
    qs, qe, ks, ke, t = (a[:, i] for i in range(5))
    lo = np.where(t & 2, ks - qs, ks - qe + 1)
    hi = np.where(t & 1, ke - qe, ke - 1 - qs)
    return int(band_area_np(qs, qe, ks, ke, lo, hi).sum())


# -- public slice objects ---------------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class AttnSlice:
    """One slice of a mask: rows `q_range`, columns `k_range`, shape `mask_type` (see module docstring)."""

    q_range: AttnRange
    k_range: AttnRange
    mask_type: AttnMaskType = AttnMaskType.FULL

    def __post_init__(self) -> None:
        object.__setattr__(self, "mask_type", AttnMaskType.from_any(self.mask_type, "mask_type"))
        for name in ("q_range", "k_range"):
            v = getattr(self, name)
            if not isinstance(v, AttnRange):
                object.__setattr__(self, name, AttnRange(*v))

    def _region(self) -> Region:
        return region_of(
            self.q_range.start, self.q_range.end, self.k_range.start, self.k_range.end, self.mask_type.code
        )

    def area(self) -> int:
        """Exact number of (q, k) pairs of the slice."""
        return band_area(*self._region())

    def _clip(self, q0: int, q1: int, k0: int, k1: int) -> list[AttnSlice]:
        r = clip_region(self._region(), q0, q1, k0, k1)
        if r is None:
            return []
        return [
            AttnSlice(AttnRange(a, b), AttnRange(c, d), _BY_CODE[t]) for a, b, c, d, t in decompose_region(r)
        ]

    def clip_q(self, start: int, end: int) -> list[AttnSlice]:
        """The rows `[start, end)` of this slice as disjoint typed slices (empty rows and columns dropped)."""
        return self._clip(start, end, self.k_range.start, self.k_range.end)

    def clip_k(self, start: int, end: int) -> list[AttnSlice]:
        """The columns `[start, end)` of this slice as disjoint typed slices (may be two or three)."""
        return self._clip(self.q_range.start, self.q_range.end, start, end)

    def to_dense(self) -> np.ndarray:
        """Bool `[sq, sk]` mask in slice-local coordinates."""
        sq, sk = self.q_range.seqlen, self.k_range.seqlen
        i = np.arange(sq)[:, None]
        j = np.arange(sk)[None, :]
        m = np.ones((sq, sk), dtype=bool)
        if self.mask_type.code & 1:
            m &= j <= i + sk - sq
        if self.mask_type.code & 2:
            m &= j >= i
        return m


@dataclass(frozen=True, slots=True)
class SliceList:
    """Slices in some coordinate system, as the kernels take them.

    `q_ranges[i]` / `k_ranges[i]` are `(start, end)` int pairs and `types[i]` the int code of slice i.
    """

    q_ranges: tuple[tuple[int, int], ...] = ()
    k_ranges: tuple[tuple[int, int], ...] = ()
    types: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if not len(self.q_ranges) == len(self.k_ranges) == len(self.types):
            raise ValueError(
                f"SliceList needs equal lengths, got {len(self.q_ranges)} q, {len(self.k_ranges)} k, "
                f"{len(self.types)} types"
            )

    @classmethod
    def from_typed(cls, slices: Iterable[TypedSlice]) -> SliceList:
        s = list(slices)
        if not s:
            return cls()
        qs, qe, ks, ke, ts = zip(*s)  # transpose at C speed
        return cls(tuple(zip(qs, qe)), tuple(zip(ks, ke)), ts)

    def typed(self) -> list[TypedSlice]:
        return [(q[0], q[1], k[0], k[1], t) for q, k, t in zip(self.q_ranges, self.k_ranges, self.types)]

    def __len__(self) -> int:
        return len(self.types)

    @property
    def is_empty(self) -> bool:
        return len(self.types) == 0

    def area(self) -> int:
        """Sum of the slices' exact areas."""
        return total_area(self.typed())

    def to_slices(self) -> list[AttnSlice]:
        return [AttnSlice(AttnRange(*q), AttnRange(*k), _BY_CODE[t]) for q, k, t in self.typed_pairs()]

    def typed_pairs(self) -> Iterable[tuple[tuple[int, int], tuple[int, int], int]]:
        return zip(self.q_ranges, self.k_ranges, self.types)

    def to_dense(self, total_q: int, total_k: int) -> np.ndarray:
        """Int `[total_q, total_k]` count of how many slices cover each pair (a valid mask has 0/1 only)."""
        out = np.zeros((total_q, total_k), dtype=np.int64)
        for (a, b), (c, d), t in self.typed_pairs():
            out[a:b, c:d] += AttnSlice(AttnRange(a, b), AttnRange(c, d), _BY_CODE[t]).to_dense()
        return out


# -- validated input --------------------------------------------------------------------------------------
def normalize_mask(
    q_ranges: Any,
    k_ranges: Any,
    attn_mask_type: Any,
    total_seqlen_q: int,
    total_seqlen_k: int,
    *,
    check_disjoint: bool = True,
) -> list[TypedSlice]:
    """Validate a user mask and return it as `(qs, qe, ks, ke, code)` tuples in input order.

    Raises `ValueError` naming the offending slice for: ranges outside the sequences, empty or negative
    ranges, unknown types and a type list of the wrong length. The mask is the union of its slices: with
    `check_disjoint` (default) slices that share (q, k) pairs are rewritten into disjoint ones covering the
    same union (`disjoint_union`; input order is kept when nothing is shared), because every consumer adds
    slices up.
    """
    qp = as_int_pairs(q_ranges, "q_ranges")
    kp = as_int_pairs(k_ranges, "k_ranges")
    if len(qp) != len(kp):
        raise ValueError(f"`q_ranges` and `k_ranges` must have the same length, got {len(qp)} and {len(kp)}")
    types = _normalize_types(attn_mask_type, len(qp))
    out: list[TypedSlice] = []
    for i, ((qs, qe), (ks, ke), t) in enumerate(zip(qp, kp, types)):
        for name, (s, e), total in (
            ("q_ranges", (qs, qe), total_seqlen_q),
            ("k_ranges", (ks, ke), total_seqlen_k),
        ):
            if s >= e:
                raise ValueError(f"`{name}[{i}]` = [{s}, {e}) is empty or negative; slices need start < end")
            if s < 0 or e > total:
                raise ValueError(f"`{name}[{i}]` = [{s}, {e}) lies outside the sequence [0, {total})")
        out.append((qs, qe, ks, ke, t))
    if check_disjoint:
        out = disjoint_union(out)
    return out


def _normalize_types(attn_mask_type: Any, n: int) -> list[int]:
    if isinstance(attn_mask_type, (str, AttnMaskType)) or not isinstance(
        attn_mask_type, (Sequence, np.ndarray)
    ):
        if hasattr(attn_mask_type, "tolist") and not isinstance(attn_mask_type, (str, AttnMaskType)):
            attn_mask_type = attn_mask_type.tolist()
            if isinstance(attn_mask_type, list):
                return _normalize_types(attn_mask_type, n)
        return [AttnMaskType.from_any(attn_mask_type).code] * n
    seq = list(attn_mask_type.tolist() if isinstance(attn_mask_type, np.ndarray) else attn_mask_type)
    if len(seq) != n:
        raise ValueError(
            f"`attn_mask_type` has {len(seq)} entries for {n} slices; give one per slice or a single type"
        )
    return [AttnMaskType.from_any(t, f"attn_mask_type[{i}]").code for i, t in enumerate(seq)]


def disjoint_union(slices: list[TypedSlice]) -> list[TypedSlice]:
    """`slices` unchanged when no two share a (q, k) pair; else disjoint typed slices with the same union.

    The mask is the union of its slices, but every consumer (areas, dispatch, the kernels) adds slices
    up, so shared pairs are cut out of later slices once, here: region minus region is at most six
    regions (rows above/below, columns left/right, diagonals below/above the band), each re-expressed in
    the four types by `decompose_region`.
    """
    regs = [region_of(*s) for s in slices]
    if not _any_shared_pair(regs):
        return slices
    kept: list[Region] = []
    for r in regs:
        pieces = [t for t in (tighten_region(*r),) if t is not None]
        for s in kept:
            if s[0] >= r[1] or s[1] <= r[0] or s[2] >= r[3] or s[3] <= r[2]:
                continue  # bounding boxes apart
            pieces = [piece for p in pieces for piece in _subtract_region(p, s)]
            if not pieces:
                break
        kept.extend(pieces)
    return [ts for r in kept for ts in decompose_region(r)]


def _intersect_regions(a: Region, b: Region) -> Region | None:
    return tighten_region(
        max(a[0], b[0]), min(a[1], b[1]), max(a[2], b[2]), min(a[3], b[3]), max(a[4], b[4]), min(a[5], b[5])
    )


def _subtract_region(p: Region, s: Region) -> list[Region]:
    """Disjoint regions whose union is `p` minus `s`."""
    if _intersect_regions(p, s) is None:
        return [p]
    qs, qe, ks, ke, lo, hi = p
    mq0, mq1 = max(qs, s[0]), min(qe, s[1])
    mk0, mk1 = max(ks, s[2]), min(ke, s[3])
    pieces = (
        tighten_region(qs, min(qe, s[0]), ks, ke, lo, hi),  # rows above s
        tighten_region(max(qs, s[1]), qe, ks, ke, lo, hi),  # rows below s
        tighten_region(mq0, mq1, ks, min(ke, s[2]), lo, hi),  # shared rows, columns left of s
        tighten_region(mq0, mq1, max(ks, s[3]), ke, lo, hi),  # shared rows, columns right of s
        tighten_region(mq0, mq1, mk0, mk1, lo, min(hi, s[4] - 1)),  # diagonals below s's band
        tighten_region(mq0, mq1, mk0, mk1, max(lo, s[5] + 1), hi),  # diagonals above s's band
    )
    return [r for r in pieces if r is not None]


def _any_shared_pair(regs: list[Region]) -> bool:
    """Sweep over q: compare each region with the earlier ones whose rows it meets (numpy when many)."""
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
        elif any(_intersect_regions(regs[i], regs[j]) is not None for j in active):
            return True
        active.append(i)
    return False
