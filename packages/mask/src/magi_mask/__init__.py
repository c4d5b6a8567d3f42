"""magi_mask: the slice-mask vocabulary and algebra, written once for every magi package (numpy only).

A mask over `[total_q] x [total_k]` is the union of slices `(q_range, k_range, type)`.

- `AttnMaskType`: the four slice types (`magi_mask.types` draws them), parsed from members, names or int codes.
- `as_int_pairs`, `normalize_types`, `validate_slices`: pure-Python input normalisation.
- Band regions (`magi_mask.region`): `region_of`, `tighten_region`, `clip_region`, `intersect_regions`,
  `subtract_region`, `decompose_region`, `disjoint_regions`, `disjoint_union` and exact areas.
- The dense oracle tests use: `dense_mask`, `slice_dense`, `region_dense`.
- `magi_mask.flags.parse_bool`: the strict boolean of every package's environment flags (each package's
  `env` module reads the variable and parses it here).
"""

from .dense import dense_mask, region_dense, slice_dense
from .ranges import TypedSlice, as_int_pairs, check_int, validate_slices
from .region import (
    Region,
    any_shared_pair,
    band_area,
    band_area_np,
    clip_region,
    decompose_region,
    disjoint_regions,
    disjoint_union,
    intersect_regions,
    region_bounds_active,
    region_of,
    slice_area,
    subtract_region,
    tighten_region,
    total_area,
)
from .types import BI_CAUSAL, CAUSAL, FULL, INV_CAUSAL, AttnMaskType, normalize_types

__version__ = "0.1.0"  # the [project] version of pyproject.toml (CI checks that they agree)

__all__ = [
    "BI_CAUSAL",
    "CAUSAL",
    "FULL",
    "INV_CAUSAL",
    "AttnMaskType",
    "Region",
    "TypedSlice",
    "any_shared_pair",
    "as_int_pairs",
    "band_area",
    "band_area_np",
    "check_int",
    "clip_region",
    "decompose_region",
    "dense_mask",
    "disjoint_regions",
    "disjoint_union",
    "intersect_regions",
    "normalize_types",
    "region_bounds_active",
    "region_dense",
    "region_of",
    "slice_area",
    "slice_dense",
    "subtract_region",
    "tighten_region",
    "total_area",
    "validate_slices",
]
