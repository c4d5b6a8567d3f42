"""The CuTe DSL masks that FA4 applies on Partial tiles (imported only when flash-attn-4 is present).

Row ``q`` sees key ``j`` iff ``bounds[q, 2i] <= j < bounds[q, 2i + 1]`` for some ``i < width``; ``bounds`` is
the single aux tensor, int32 ``[rows_padded, 2 * width]`` (padding slots and padded rows hold ``0, 0`` and
match nothing; every end is ``<= total_k``, so keys past the sequence are masked too). ``width`` is a
compile-time constant: one kernel per interval count.

Two evaluations of the same mask:

- :func:`interval_mask_mod` is a plain FA4 ``mask_mod``, called once per score element (``2 * width``
  compares against the row's bounds).
- :func:`interval_mask_mod_r2p` is the same callable tagged with ``magi_interval_width``. For it,
  :func:`install_r2p_patch` makes FA4's ``AttentionMask.apply_mask`` take the register-to-predicate path that
  FA4 uses for its own causal/window masks: per row it loads the ``width`` intervals once, builds a 32-bit
  keep-mask per 32 accumulator columns by OR-ing ``below(end) & above(start)`` for each interval, and selects
  ``-inf`` through the mask bits. Only the sm90 forward layout (not ``swap_AB``) takes that path; the sm90
  backward (``swap_AB``) and sm100 keep the per-element mask_mod.

The patch is installed only on the flash-attn-4 releases whose ``apply_mask`` it was written against
(``_fa4_version.SUPPORTED``: its signature and the helpers used here are the same in 4.0.0b36 and
4.0.0b40); on any other release the tagged mask runs as the plain per-element mask_mod.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import cutlass
import cutlass.cute as cute
from cutlass import Uint32, const_expr
from flash_attn.cute import mask as fa_mask
from flash_attn.cute.utils import AuxData, scalar_to_ssa
from quack import layout_utils

from . import _fa4_version


def _row_sees(bounds, row, kv_idx, width: int):
    """Whether ``row`` sees key ``kv_idx`` through any of its ``width`` intervals. Plain Python, called while
    a mask function below is traced: the loop over a Python ``width`` unrolls at trace time, as
    ``range_constexpr`` does inside a ``cute.jit`` body."""
    lo = scalar_to_ssa(bounds[row, 0], cutlass.Int32)
    hi = scalar_to_ssa(bounds[row, 1], cutlass.Int32)
    hit = (kv_idx >= lo) & (kv_idx < hi)
    for i in range(1, width):
        lo_i = scalar_to_ssa(bounds[row, 2 * i], cutlass.Int32)
        hi_i = scalar_to_ssa(bounds[row, 2 * i + 1], cutlass.Int32)
        hit = hit | ((kv_idx >= lo_i) & (kv_idx < hi_i))
    return hit


# Two mask functions with one body (_row_sees): FA4 keys its compiled kernels by a mask function's source and
# captured values, so the per-element and the row-bitmask variants must stay two functions of their own names.
@functools.cache
def interval_mask_mod(width: int):
    """Per-element mask_mod for rows of at most ``width`` intervals (cached: one object per width)."""

    @cute.jit
    def magi_interval_mask(batch, head, q_idx, kv_idx, seqlen_info, aux_tensors):
        return _row_sees(aux_tensors[0], q_idx[0], kv_idx, width)

    return magi_interval_mask


@functools.cache
def interval_mask_mod_r2p(width: int):
    """The same mask, tagged so that the patched ``apply_mask`` evaluates it with row bitmasks."""

    @cute.jit
    def magi_interval_mask_r2p(batch, head, q_idx, kv_idx, seqlen_info, aux_tensors):
        return _row_sees(aux_tensors[0], q_idx[0], kv_idx, width)

    magi_interval_mask_r2p.magi_interval_width = width
    return magi_interval_mask_r2p


_ORIG_APPLY_MASK = fa_mask.AttentionMask.apply_mask


@cute.jit
def _apply_mask_with_intervals(
    self,
    acc_S: cute.Tensor,
    batch_idx: cutlass.Int32,
    head_idx: cutlass.Int32,
    m_block: cutlass.Int32,
    n_block: cutlass.Int32,
    thr_mma: cute.TiledMma,
    mask_seqlen: cutlass.Constexpr[bool],
    mask_causal: cutlass.Constexpr[bool],
    mask_local: cutlass.Constexpr[bool] = False,
    mask_mod: cutlass.Constexpr[Callable | None] = None,
    aux_data: AuxData = AuxData(),  # noqa: B008  (FA4's own default, a constant NamedTuple)
    fastdiv_mods=(None, None),
) -> None:
    if const_expr(
        mask_mod is not None
        and getattr(mask_mod, "magi_interval_width", 0) > 0
        and not self.swap_AB
        and not mask_causal
        and not mask_local
    ):
        width = const_expr(mask_mod.magi_interval_width)
        acc_S_mn = layout_utils.reshape_acc_to_mn(acc_S)
        cS = cute.make_identity_tensor((self.tile_m, self.tile_n))
        tScS_mn = layout_utils.reshape_acc_to_mn(thr_mma.partition_C(cS))
        thr_col_offset = tScS_mn[0][1]
        if n_block < 0:
            n_block = 0
        # bounds relative to this thread's first accumulator column, as FA4's causal path does
        col_base = n_block * self.tile_n + thr_col_offset
        bounds = aux_data.tensors[0]
        for r in cutlass.range_constexpr(cute.size(tScS_mn.shape[0])):
            row = tScS_mn[r, 0][0] + m_block * self.tile_m
            if const_expr(self.qhead_per_kvhead_packgqa != 1):
                row = row // self.qhead_per_kvhead_packgqa
            los = []
            his = []
            for i in cutlass.range_constexpr(width):
                los.append(fa_mask.sm90_col_to_r2p_idx(bounds[row, 2 * i] - col_base))
                his.append(fa_mask.sm90_col_to_r2p_idx(bounds[row, 2 * i + 1] - col_base))

            # called right here by mask_r2p_lambda, once per 32-column chunk, while los/his are this row's
            def keep_bits(s: int) -> Uint32:
                bits = fa_mask.r2p_bitmask_below(his[0], s) & fa_mask.r2p_bitmask_above(los[0], s)  # noqa: B023
                for i in cutlass.range_constexpr(1, width):
                    bits = bits | (
                        fa_mask.r2p_bitmask_below(his[i], s) & fa_mask.r2p_bitmask_above(los[i], s)  # noqa: B023
                    )
                return bits

            fa_mask.mask_r2p_lambda(acc_S_mn[r, None], keep_bits, rank1=True)
    else:
        _ORIG_APPLY_MASK(
            self,
            acc_S,
            batch_idx,
            head_idx,
            m_block,
            n_block,
            thr_mma,
            mask_seqlen,
            mask_causal,
            mask_local,
            mask_mod,
            aux_data,
            fastdiv_mods,
        )


def install_r2p_patch() -> bool:
    """Route FA4's ``AttentionMask.apply_mask`` through the interval bitmask path (idempotent; masks
    without ``magi_interval_width`` go to FA4's original code unchanged). Returns False, patching nothing,
    on a flash-attn-4 release this patch was not written against (:func:`_fa4_version.mask_patch_supported`)."""
    if not _fa4_version.mask_patch_supported(_fa4_version.installed()):
        return False
    if fa_mask.AttentionMask.apply_mask is not _apply_mask_with_intervals:
        fa_mask.AttentionMask.apply_mask = _apply_mask_with_intervals
    return True
