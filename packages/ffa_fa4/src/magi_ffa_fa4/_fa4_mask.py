"""The CuTe DSL mask_mod that FA4 evaluates on Partial tiles (imported only when flash-attn-4 is present).

Row ``q`` sees key ``j`` iff ``bounds[q, 2i] <= j < bounds[q, 2i + 1]`` for some ``i < width``; ``bounds`` is
the single aux tensor, int32 ``[rows_padded, 2 * width]`` (padding slots and padded rows hold ``0, 0`` and
match nothing). ``width`` is a compile-time constant, so one kernel is compiled per interval count.

FA4 4.0.0b36 calls a mask_mod once per score element on sm80/sm90 (``AttentionMask.apply_mask``: scalar
q/kv indices, no per-row hook), so the per-row bitmask of the original system cannot be expressed through
this interface on Hopper: each element costs ``2 * width`` compares against row bounds that the compiler
loads once per row. Full tiles never call it; Empty tiles are never visited.
"""

from __future__ import annotations

import functools

import cutlass
import cutlass.cute as cute
from flash_attn.cute.utils import scalar_to_ssa


@functools.cache
def interval_mask_mod(width: int):
    """The mask_mod for rows of at most ``width`` intervals (cached: one object, one compile hash each)."""

    @cute.jit
    def magi_interval_mask(batch, head, q_idx, kv_idx, seqlen_info, aux_tensors):
        bounds = aux_tensors[0]
        row = q_idx[0]
        lo = scalar_to_ssa(bounds[row, 0], cutlass.Int32)
        hi = scalar_to_ssa(bounds[row, 1], cutlass.Int32)
        hit = (kv_idx >= lo) & (kv_idx < hi)
        for i in cutlass.range_constexpr(1, width):
            lo_i = scalar_to_ssa(bounds[row, 2 * i], cutlass.Int32)
            hi_i = scalar_to_ssa(bounds[row, 2 * i + 1], cutlass.Int32)
            hit = hit | ((kv_idx >= lo_i) & (kv_idx < hi_i))
        return hit

    return magi_interval_mask
