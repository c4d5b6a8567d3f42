"""This package's own input checks (tile sizes); the slice checks are magi_ffa's (``magi_ffa.validation``).

Glossary (used in every docstring of this package; the shared words are in ``docs/glossary.md``):

- ``total_q`` / ``total_k``: number of query / key tokens (packed, no batch axis).
- ``num_heads_q`` / ``num_heads_kv``: query / key-value heads, ``num_heads_q % num_heads_kv == 0`` (GQA/MQA).
- ``head_dim``: the per-head feature size, equal for q, k and v.
- slice ``i``: query rows ``[q_ranges[i, 0], q_ranges[i, 1])`` attend to key rows ``[k_ranges[i, 0],
  k_ranges[i, 1])`` with the shape ``attn_type_map[i]`` (:class:`magi_mask.AttnMaskType`). The mask is the
  **union** of the slices: a (query, key) pair covered by several slices is visible once.
- row intervals: for each query row, the sorted, merged, disjoint half-open key intervals it sees.
- tile ``(m, n)``: query rows ``[m * block_m, (m + 1) * block_m)`` x keys
  ``[n * block_n, (n + 1) * block_n)``.
"""

from __future__ import annotations

from magi_ffa.validation import RangesLike, TypeMapLike

__all__ = ["RangesLike", "TypeMapLike", "check_block"]


def check_block(name: str, value: object) -> int:
    """Return a positive int tile size or raise ValueError naming it."""
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"`{name}` must be a positive int, got {value!r}")
    return value
