"""Input checks shared by the metadata builders and the attention entry point: magi_ffa's, moved to the
device this package computes on.

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

import torch
from magi_mask import AttnMaskType

from magi_ffa import validation as ffa_validation
from magi_ffa.validation import RangesLike, TypeMapLike

AttnType = AttnMaskType  # the package's historical name of the one mask-type enum

__all__ = ["AttnType", "RangesLike", "TypeMapLike", "as_ranges", "as_type_map", "check_block", "check_slices"]


def as_ranges(x: RangesLike, name: str, device: torch.device) -> torch.Tensor:
    """``x`` as a contiguous int32 ``[num_slices, 2]`` tensor on ``device`` (``magi_ffa.validation.as_ranges``)."""
    if isinstance(x, torch.Tensor) and x.device != device:
        x = x.cpu()  # this package moves ranges to its device; magi_ffa only takes q's device or the CPU
    return ffa_validation.as_ranges(x, name, device).to(device).contiguous()


def as_type_map(x: TypeMapLike, n: int, device: torch.device) -> torch.Tensor:
    """``attn_type_map`` as a contiguous int32 ``[num_slices]`` tensor on ``device`` (None = all FULL;
    ints, names and ``AttnMaskType`` members as in ``magi_ffa.validation.as_type_map``)."""
    if isinstance(x, torch.Tensor) and x.device != device:
        x = x.cpu()
    return ffa_validation.as_type_map(x, n, device).to(device).contiguous()


def check_slices(
    q_ranges: torch.Tensor, k_ranges: torch.Tensor, type_map: torch.Tensor, total_q: int, total_k: int
) -> None:
    """Raise ValueError naming the first bad slice (magi_ffa's host check, cached by value; one host copy)."""
    if not isinstance(total_q, int) or not isinstance(total_k, int) or total_q < 0 or total_k < 0:
        raise ValueError(f"`total_q` and `total_k` must be ints >= 0, got {total_q!r} and {total_k!r}")
    ffa_validation.host_slices(q_ranges.cpu(), k_ranges.cpu(), type_map.cpu(), total_q, total_k)


def check_block(name: str, value: object) -> int:
    """Return a positive int tile size or raise ValueError naming it."""
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"`{name}` must be a positive int, got {value!r}")
    return value
