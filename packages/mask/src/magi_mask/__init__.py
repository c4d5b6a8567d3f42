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

# The package exports exactly its modules' public names; each module's ``__all__`` is the one list of them.
from . import dense, ranges, region, types
from .dense import *  # noqa: F403
from .ranges import *  # noqa: F403
from .region import *  # noqa: F403
from .types import *  # noqa: F403

__version__ = "0.1.0"  # the [project] version of pyproject.toml (CI checks that they agree)

__all__ = [*types.__all__, *region.__all__, *ranges.__all__, *dense.__all__]
