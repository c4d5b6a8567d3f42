"""Per-mask launch metadata: intervals -> aux tensor + FA4 block-sparse tensors, cached by mask value.

``LaunchMeta`` is everything FA4 needs besides q/k/v (not a *plan*: that word is the planner's, see
docs/glossary.md): the interval bounds (mask_mod's aux tensor), the forward
(q->k) and backward (k->q) block lists in FA4's layout, the mask_mod for the interval count. Entries are
cached by the *values* of the range tensors (``magi_ffa.mask_cache.MaskValueCache``).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from magi_ffa.intervals import RowIntervals, row_intervals
from magi_ffa.mask_cache import MaskValueCache
from magi_ffa.validation import RangesLike, TypeMapLike, host_slices

from . import env
from .blocks import BlockLists, BlockSparseMeta, build_block_meta
from .varlen import VarlenPlan, plan_varlen, varlen_possible

CACHE_SIZE = env.plan_cache_size()  # entries kept (LRU), one per distinct mask (MAGI_FFA_FA4_PLAN_CACHE)
ROW_PAD = 256  # aux rows are padded so any tile of up to 256 rows reads inside the tensor
WIDTH_FLOOR = 1
"""Smallest interval-width bucket (see :func:`width_bucket`)."""


@dataclass(frozen=True, slots=True)
class LaunchMeta:
    """Launch metadata of one mask (see module docstring). ``fwd_bst`` / ``bwd_bst`` are
    ``flash_attn.cute.block_sparsity.BlockSparseTensorsTorch``; ``bounds`` is int32
    ``[rows_padded, 2 * width]``."""

    total_q: int
    total_k: int
    width: int
    """Interval slots per row in ``bounds`` (the compiled mask's width): :func:`width_bucket` of the mask's
    largest interval count, so that masks of nearby counts share one compiled kernel."""
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


def width_bucket(width: int) -> int:
    """The interval width a mask of at most ``width`` intervals per row is compiled for: the next power of
    two, at least :data:`WIDTH_FLOOR` (1, 2, 4, 8, ...).

    FA4 compiles one kernel per mask function, and the interval mask function unrolls over its width, so
    without buckets every new largest interval count (a new random mask, a new rank problem at cp > 1)
    compiled a new forward and backward kernel. The slots past a row's intervals hold ``(0, 0)``, which
    match no key: the padded mask is the same mask. The price is ``2 * (bucket - width)`` more compares per
    element of the Partial tiles, at most twice the unpadded work.
    """
    if isinstance(width, bool) or not isinstance(width, int) or width < 0:
        raise ValueError(f"`width` must be a non-negative int, got {width!r}")
    return max(WIDTH_FLOOR, 1 << max(width - 1, 0).bit_length())


def interval_bounds(iv: RowIntervals, device: torch.device) -> torch.Tensor:
    """The aux tensor of the interval mask: int32 ``[rows_padded, 2 * width_bucket(iv.width)]`` on
    ``device``, row ``q`` holding ``start_0, end_0, start_1, end_1, ...`` and ``0, 0`` in the unused slots
    and in the padded rows (``rows_padded``: ``total_q`` rounded up to :data:`ROW_PAD`, at least one pad)."""
    total_q = iv.starts.shape[0]
    width = width_bucket(iv.width)
    rows = max(-(-total_q // ROW_PAD) * ROW_PAD, ROW_PAD)
    bounds = torch.zeros(rows, 2 * width, dtype=torch.int32, device=device)
    bounds[:total_q, 0 : 2 * iv.width : 2] = iv.starts.to(device)
    bounds[:total_q, 1 : 2 * iv.width : 2] = iv.ends.to(device)
    return bounds


def build_mask_meta(
    q_ranges: torch.Tensor,
    k_ranges: torch.Tensor,
    type_map: torch.Tensor,
    total_q: int,
    total_k: int,
    device: torch.device,
) -> LaunchMeta:
    """The mask's part of the launch metadata, without FA4 objects (``fwd_bst``, ``bwd_bst`` and
    ``mask_mod`` are None): FA4 varlen groups when the mask's slices form few of them (and
    ``MAGI_FFA_FA4_VARLEN`` allows), else the interval bounds and block lists. Needs only torch (and
    Triton for the intervals on CUDA); :func:`compile_key` reads it."""
    if env.varlen():
        slices = host_slices(q_ranges.cpu(), k_ranges.cpu(), type_map.cpu(), total_q, total_k)
        plan = plan_varlen(slices, total_q, total_k, device)
        if plan is not None:
            return LaunchMeta(
                total_q=total_q, total_k=total_k, width=0, bounds=None, meta_fwd=None, meta_bwd=None,
                fwd_bst=None, bwd_bst=None, mask_mod=None, has_empty_rows=not plan.q_covered, varlen=plan,
            )  # fmt: skip
    iv = row_intervals(q_ranges, k_ranges, type_map, total_q, total_k)
    fwd_block, bwd_block = tile_sizes(device)
    meta_fwd = build_block_meta(iv, *fwd_block)
    meta_bwd = meta_fwd if bwd_block == fwd_block else build_block_meta(iv, *bwd_block)
    bounds = interval_bounds(iv, device)
    return LaunchMeta(
        total_q=total_q,
        total_k=total_k,
        width=bounds.shape[1] // 2,
        bounds=bounds,
        meta_fwd=meta_fwd,
        meta_bwd=meta_bwd,
        fwd_bst=None,
        bwd_bst=None,
        mask_mod=None,
        has_empty_rows=meta_fwd.has_empty_rows,
        empty_rows=(iv.counts == 0).nonzero().flatten() if meta_fwd.has_empty_rows else None,
    )


def build_launch_meta(
    q_ranges: torch.Tensor,
    k_ranges: torch.Tensor,
    type_map: torch.Tensor,
    total_q: int,
    total_k: int,
    device: torch.device,
) -> LaunchMeta:
    """Build the launch metadata on ``device``: :func:`build_mask_meta` plus, on the block-sparse path,
    FA4's block-sparse tensors and the interval mask_mod of the bucketed width (imports FA4)."""
    meta = build_mask_meta(q_ranges, k_ranges, type_map, total_q, total_k, device)
    if meta.varlen is not None:
        return meta
    from ._fa4_mask import install_r2p_patch, interval_mask_mod, interval_mask_mod_r2p  # imports cutlass

    fwd_block, bwd_block = tile_sizes(device)
    return dataclasses.replace(
        meta,
        fwd_bst=_to_bst(meta.meta_fwd.q2k, fwd_block),
        bwd_bst=_to_bst(meta.meta_bwd.k2q, bwd_block),
        mask_mod=_mask_mod(meta.width, install_r2p_patch, interval_mask_mod, interval_mask_mod_r2p),
    )


# ----------------------------------------------------------------------------------------------- compile keys
# FA4 4.0.0b36 keeps one compiled kernel per key of ``flash_attn.cute.interface._flash_attn_fwd`` /
# ``_flash_attn_bwd`` (``compile_key``). Besides the problem's configuration (dtype, head dims, heads,
# softcap, determinism, architecture) a key holds, of what a mask changes: the mask function's hash
# (``utils.hash_callable``: its code and captured values, here the interval width), the stride-0 pattern of
# the block-sparse tensors (never their shapes: FA4 accepts compact index tables of any width), the aux
# tensors' dtype and static strides (never their shapes), whether ``seqused`` is given, the causal / window
# flags, whether a sequence fits one tile (``max_m_blocks_leq_one``, ``single_q_block``,
# ``single_k_block``) and whether a varlen batch holds more than ``BIN_BATCH_SEARCH_THRESH`` (256) entries.
_FA4_BATCH_SEARCH = 256


def _bwd_tile(arch: int, head_dim: int) -> tuple[int, int]:
    """FA4's backward tile (rows, keys) for block-sparse and varlen masks (``_tile_size_bwd_sm90`` with a
    128-row sparse block; 128 x 128 on sm100)."""
    if arch // 10 != 9:
        return 128, 128
    return (128, 128) if head_dim <= 64 else (64, 128)


def _window_flags(kw: dict) -> tuple[bool, bool, bool]:
    """(causal, window_left given, window_right given) as FA4's ``_resolve_causal_local_window`` leaves them."""
    causal, left, right = kw["causal"], kw["window_size_left"], kw["window_size_right"]
    if left is not None and right is not None and left < 0 and right < 0:
        left = right = None
    if causal:
        right = 0
    if left is None and right == 0:
        return True, False, False
    return False, left is not None, right is not None


def compile_key(
    meta: LaunchMeta,
    *,
    dtype: torch.dtype,
    head_dim: int,
    num_heads_q: int,
    num_heads_kv: int,
    softcap: float = 0.0,
    deterministic: bool = False,
    arch: int = 90,
    r2p: bool | None = None,
) -> tuple:
    """The FA4 kernels one call of this mask runs, as a hashable tuple of per-kernel keys (forward, then
    backward; each group of a varlen mask adds its own pair, equal keys once).

    A pure function mirroring what FA4 4.0.0b36's compile keys read (see the comment above): two masks
    with equal keys run on the same compiled kernels, so a new mask compiles nothing when its key was seen.
    What a mask can change is bounded: the interval width bucket (:func:`width_bucket`), the window kind
    of a varlen group (full, causal, left, right or both sides bounded), whether a sequence fits one tile
    (at most 128 tokens; :data:`~magi_ffa_fa4.varlen.SEQLEN_FLOOR` removes it for varlen groups) and
    whether a varlen group holds more than 256 entries.

    Args:
        meta: launch metadata (:func:`build_mask_meta` or :func:`get_launch_meta`).
        dtype: q's dtype (fp16 / bf16).
        head_dim: q / k / v head dim.
        num_heads_q, num_heads_kv: heads of q and of k / v.
        softcap: > 0 adds FA4's soft-capping score_mod.
        deterministic: the backward's deterministic mode.
        arch: FA4's architecture number (``major * 10 + minor``: 90 Hopper, 100 Blackwell).
        r2p: the row-bitmask forward (default: ``MAGI_FFA_FA4_R2P``, as the launch metadata reads it).
    """
    r2p = r2p_enabled() if r2p is None else bool(r2p)
    gqa = num_heads_q // num_heads_kv
    common = (arch, dtype, head_dim, gqa, softcap > 0)
    bwd_m, bwd_n = _bwd_tile(arch, head_dim)
    keys: dict[tuple, None] = {}
    if meta.varlen is None:
        # the block-sparse tensors are [1, 1, rows, width] expanded over heads: stride 0 when heads > 1
        broadcast = num_heads_q > 1
        mask_fn = ("magi_interval_mask_r2p" if r2p else "magi_interval_mask", meta.width)
        keys[("fwd", "block_sparse", *common, mask_fn, broadcast)] = None
        single_q, single_k = meta.total_q <= bwd_m, meta.total_k <= bwd_n
        keys[("bwd", "block_sparse", *common, deterministic, mask_fn, broadcast, single_q, single_k)] = None
        return tuple(keys)
    fwd_tile_m = 128
    for g in meta.varlen.groups:
        kw = g.fa4_kwargs()
        window = _window_flags(kw)
        used = (kw["seqused_q"] is None, kw["seqused_k"] is None)
        batch_search = len(g.q_ranges) > _FA4_BATCH_SEARCH
        rows_q = kw["max_seqlen_q"] * gqa  # packed GQA rows of the longest entry
        q_stage = 2 if arch // 10 in (10, 11) and rows_q > fwd_tile_m else 1
        static = rows_q <= q_stage * fwd_tile_m  # FA4's is_static_persistent for varlen with a host max
        keys[("fwd", "varlen", *common, window, used, static, batch_search)] = None
        single = (kw["max_seqlen_q"] <= bwd_m, kw["max_seqlen_k"] <= bwd_n)
        keys[("bwd", "varlen", *common, deterministic, window, used, single, batch_search)] = None
    return tuple(keys)


def warmup_masks(total: int, widths: tuple[int, ...] = (1, 2, 4, 8, 16)) -> list[tuple[list, list, list]]:
    """Masks over ``total`` tokens (``q_ranges, k_ranges, types`` lists) whose FA4 launches compile the kernel
    variants later masks of this size meet: the block-sparse path at each interval width in ``widths`` (rows
    that see exactly that many key bands; width 1: documents shorter than the varlen path takes) and the
    varlen path's window kinds (full, causal, inverse-causal and bidirectional-causal documents, a sliding
    window). Running each once (forward and backward) before the first step moves those compiles out of the
    training loop; a mask past the largest width bucket still compiles its own.

    Args:
        total: tokens of q and k, at least 512 and at least ``32 * max(widths)``.
        widths: interval counts per row to warm up (their buckets, :func:`width_bucket`, are compiled).
    """
    top = max(widths, default=1)
    if isinstance(total, bool) or not isinstance(total, int) or total < max(512, 32 * top):
        raise ValueError(
            f"`total` must be an int >= max(512, 32 * max(widths)) = {max(512, 32 * top)}, got {total!r}"
        )
    half = total // 2
    docs = [[0, half], [half, total]]
    out = [(docs, docs, [kind, kind]) for kind in (0, 1, 2, 3)]  # varlen documents of each type
    w = total // 8  # a sliding window: its causal head and its band, one windowed varlen entry
    out.append(([[0, w], [w, total]], [[0, w], [1, total]], [1, 3]))
    for width in widths:
        if width == 1:  # short causal documents: one interval per row, too short for the varlen path
            short = [[a, min(a + 64, total)] for a in range(0, total, 64)]
            out.append((short, short, [1] * len(short)))
            continue
        band = total // (2 * width)  # every row sees `width` disjoint key bands
        bands = [[2 * i * band, 2 * i * band + band] for i in range(width)]
        out.append(([[0, total]] * width, bands, [0] * width))
    return out


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
    """Empty the launch-metadata cache (frees its device tensors; local to this process)."""
    _CACHE.clear()


# public since the first release (magi_ffa_fa4.clear_plan_cache); the same function
clear_plan_cache = clear_launch_cache
