"""Per-mask launch metadata: intervals -> aux tensor + FA4 block-sparse tensors, cached by mask value.

``LaunchMeta`` is everything FA4 needs besides q/k/v (not a *plan*: that word is the planner's, see
docs/glossary.md): the interval bounds (mask_mod's aux tensor), the forward
(q->k) and backward (k->q) block lists in FA4's layout, the mask_mod for the interval count. Entries are
cached by the *values* of the range tensors (``magi_ffa.mask_cache.MaskValueCache``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from magi_ffa.intervals import row_intervals
from magi_ffa.mask_cache import MaskValueCache
from magi_ffa.validation import RangesLike, TypeMapLike, host_slices

from . import env
from .blocks import BlockLists, BlockSparseMeta, build_block_meta
from .varlen import VarlenPlan, plan_varlen, varlen_possible

CACHE_SIZE = env.plan_cache_size()  # entries kept (LRU), one per distinct mask (MAGI_FFA_FA4_PLAN_CACHE)
ROW_PAD = 256  # aux rows are padded so any tile of up to 256 rows reads inside the tensor


@dataclass(frozen=True, slots=True)
class LaunchMeta:
    """Launch metadata of one mask (see module docstring). ``fwd_bst`` / ``bwd_bst`` are
    ``flash_attn.cute.block_sparsity.BlockSparseTensorsTorch``; ``bounds`` is int32
    ``[rows_padded, 2 * width]``."""

    total_q: int
    total_k: int
    width: int
    bounds: torch.Tensor | None
    meta_fwd: BlockSparseMeta | None
    meta_bwd: BlockSparseMeta | None
    fwd_bst: object
    bwd_bst: object
    mask_mod: object
    has_empty_rows: bool
    varlen: VarlenPlan | None = None
    """Set when the mask runs as FA4 varlen calls (``varlen.plan_varlen``): then the block-sparse fields are
    None and both directions use the groups."""
    empty_rows: torch.Tensor | None = None
    """int64 indices of the rows that see no key (block-sparse path, when ``has_empty_rows``): the forward
    zeroes those rows only, not the whole output."""


def tile_sizes(device: torch.device) -> tuple[tuple[int, int], tuple[int, int]]:
    """Sparse block sizes ((fwd m, n), (bwd m, n)) FA4 accepts on this device.

    sm90: 128 x 128 both ways (FA4 picks 128 x 128 forward tiles and 64-row backward tiles, two per sparse
    block, for head_dim <= 128). sm100/sm110: the forward runs two 128-row Q stages per CTA, so a forward
    sparse block is 256 rows (untested: no Blackwell machine was available).
    """
    major = torch.cuda.get_device_capability(device)[0] if device.type == "cuda" else 9
    if major in (10, 11):
        return (256, 128), (128, 128)
    return (128, 128), (128, 128)


def _to_bst(lists: BlockLists, block: tuple[int, int]):
    from flash_attn.cute.block_sparsity import BlockSparseTensorsTorch

    def four(t: torch.Tensor) -> torch.Tensor:
        return t.reshape(1, 1, *t.shape).contiguous()

    return BlockSparseTensorsTorch(
        mask_block_cnt=four(lists.mask_cnt),
        mask_block_idx=four(lists.padded(full=False)),
        full_block_cnt=four(lists.full_cnt),
        full_block_idx=four(lists.padded(full=True)),
        block_size=block,
    )


def r2p_enabled() -> bool:
    """Row-bitmask masking on sm90 forward tiles (``MAGI_FFA_FA4_R2P=0`` falls back to the per-element
    mask_mod everywhere). Read when launch metadata is built; call :func:`clear_launch_cache` after changing it."""
    return env.r2p()


def _mask_mod(width: int, install, plain, r2p):
    if not r2p_enabled():
        return plain(width)
    install()
    return r2p(width)


def build_launch_meta(
    q_ranges: torch.Tensor,
    k_ranges: torch.Tensor,
    type_map: torch.Tensor,
    total_q: int,
    total_k: int,
    device: torch.device,
) -> LaunchMeta:
    """Build the launch metadata on ``device``: FA4 varlen groups when the mask's slices form few of them
    (and ``MAGI_FFA_FA4_VARLEN`` allows), else intervals (the Triton kernel on CUDA) and block lists."""
    if env.varlen():
        slices = host_slices(q_ranges.cpu(), k_ranges.cpu(), type_map.cpu(), total_q, total_k)
        plan = plan_varlen(slices, total_q, total_k, device)
        if plan is not None:
            return LaunchMeta(
                total_q=total_q, total_k=total_k, width=0, bounds=None, meta_fwd=None, meta_bwd=None,
                fwd_bst=None, bwd_bst=None, mask_mod=None, has_empty_rows=not plan.q_covered, varlen=plan,
            )  # fmt: skip
    from ._fa4_mask import install_r2p_patch, interval_mask_mod, interval_mask_mod_r2p  # imports cutlass

    iv = row_intervals(q_ranges, k_ranges, type_map, total_q, total_k)
    fwd_block, bwd_block = tile_sizes(device)
    meta_fwd = build_block_meta(iv, *fwd_block)
    meta_bwd = meta_fwd if bwd_block == fwd_block else build_block_meta(iv, *bwd_block)
    rows = max(-(-total_q // ROW_PAD) * ROW_PAD, ROW_PAD)
    bounds = torch.zeros(rows, 2 * iv.width, dtype=torch.int32, device=device)
    bounds[:total_q, 0::2] = iv.starts
    bounds[:total_q, 1::2] = iv.ends
    return LaunchMeta(
        total_q=total_q,
        total_k=total_k,
        width=iv.width,
        bounds=bounds,
        meta_fwd=meta_fwd,
        meta_bwd=meta_bwd,
        fwd_bst=_to_bst(meta_fwd.q2k, fwd_block),
        bwd_bst=_to_bst(meta_bwd.k2q, bwd_block),
        mask_mod=_mask_mod(iv.width, install_r2p_patch, interval_mask_mod, interval_mask_mod_r2p),
        has_empty_rows=meta_fwd.has_empty_rows,
        empty_rows=(iv.counts == 0).nonzero().flatten() if meta_fwd.has_empty_rows else None,
    )


def takes_varlen(slices, total_q: int, total_k: int) -> bool:
    """Whether :func:`build_launch_meta` runs these checked slices (``magi_ffa``'s host slices) as FA4 varlen
    calls (the path whose backward has a deterministic mode) rather than the block-sparse path."""
    return env.varlen() and varlen_possible(slices)


_CACHE: MaskValueCache[LaunchMeta] = MaskValueCache(CACHE_SIZE)


def get_launch_meta(
    q_ranges: RangesLike,
    k_ranges: RangesLike,
    attn_type_map: TypeMapLike,
    total_q: int,
    total_k: int,
    device: torch.device,
) -> LaunchMeta:
    """The cached launch metadata of this mask, building (and validating) it on a miss."""

    def build(qr: torch.Tensor, kr: torch.Tensor, tm: torch.Tensor) -> LaunchMeta:
        return build_launch_meta(qr, kr, tm, total_q, total_k, device)

    tables = (q_ranges, k_ranges, attn_type_map)
    return _CACHE.get(tables, total_q=total_q, total_k=total_k, device=device, build=build)


def clear_launch_cache() -> None:
    """Drop every cached launch metadata (frees their device tensors)."""
    _CACHE.clear()


# public since the first release (magi_ffa_fa4.clear_plan_cache); the same function
clear_plan_cache = clear_launch_cache
