"""Slice objects of the planner (`AttnSlice`, `SliceList`) and the validated mask input (`normalize_mask`).

A mask over `[total_q] x [total_k]` is the union of slices `(q_range, k_range, type)`. The four types
(`AttnMaskType`) and the band-region algebra the planner clips and measures slices with (`region_of`,
`tighten_region`, `clip_region`, `decompose_region`, `disjoint_union`, `band_area`, ...) live in `magi_mask`,
the lowest layer, and are re-exported here under their old names.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import numpy as np
from magi_mask import (
    BI_CAUSAL,
    CAUSAL,
    FULL,
    INV_CAUSAL,
    AttnMaskType,
    Region,
    TypedSlice,
    band_area,
    band_area_np,
    clip_region,
    decompose_region,
    dense_mask,
    disjoint_union,
    region_of,
    slice_area,
    slice_dense,
    tighten_region,
    total_area,
    validate_slices,
)

from .ranges import AttnRange

__all__ = [
    "BI_CAUSAL",
    "CAUSAL",
    "FULL",
    "INV_CAUSAL",
    "AttnMaskType",
    "AttnSlice",
    "SliceList",
    "band_area",
    "band_area_np",
    "clip_region",
    "decompose_region",
    "disjoint_union",
    "normalize_mask",
    "region_of",
    "slice_area",
    "tighten_region",
    "total_area",
]

_BY_CODE = {t.code: t for t in AttnMaskType}


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
        return slice_dense(self.q_range.seqlen, self.k_range.seqlen, self.mask_type)


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
        if self.is_empty:
            return np.zeros((total_q, total_k), dtype=np.int64)
        return dense_mask(self.q_ranges, self.k_ranges, self.types, total_q, total_k, count=True)


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
    ranges, unknown types and a type list of the wrong length (`magi_mask.validate_slices`). The mask is the
    union of its slices: with `check_disjoint` (default) slices that share (q, k) pairs are rewritten into
    disjoint ones covering the same union (`disjoint_union`; input order is kept when nothing is shared),
    because every consumer adds slices up.
    """
    out = validate_slices(q_ranges, k_ranges, attn_mask_type, total_seqlen_q, total_seqlen_k)
    return disjoint_union(out) if check_disjoint else out
