"""Per-mask launch metadata: intervals -> aux tensor + FA4 block-sparse tensors, cached by mask value.

``LaunchMeta`` is everything FA4 needs besides q/k/v (not a *plan*: that word is the planner's, see
docs/glossary.md): the interval bounds (mask_mod's aux tensor), the forward
(q->k) and backward (k->q) block lists in FA4's layout, the mask_mod for the interval count. It is FA4's
launch data in the mask's entry of magi_ffa's one mask cache (``magi_ffa.mask_cache.MASKS``: found by the
tables' identity, else their value).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from magi_ffa.intervals import RowIntervals, row_intervals
from magi_ffa.mask_cache import MASKS
from magi_ffa.validation import CheckedSlices, RangesLike, TypeMapLike, host_slices

from . import _fa4_version, env
from .blocks import BlockLists, BlockSparseMeta, build_block_meta
from .varlen import VarlenPlan, plan_varlen, varlen_possible

CACHE_SIZE = (
    env.plan_cache_size()
)  # masks holding FA4's metadata (LRU) in the mask cache (MAGI_FFA_FA4_PLAN_CACHE)
ROW_PAD = 256  # aux rows are padded so any tile of up to 256 rows reads inside the tensor
HOST_BUILD_MAX_PAIRS = 1 << 25
"""Masks of at most this many (query row, key) pairs (``total_q * total_k``: 2k x 16k, 4k x 8k, 5.8k x
5.8k) have their block-sparse metadata built on the host for a CUDA target (:func:`metadata_device`).

On the device the build is a few hundred small kernels and about a hundred stream synchronizations
(``nonzero``, ``bincount``, ``unique``, ``.item()``), each of which waits for the attention kernels already
queued, so a new mask per step stalls the host behind the GPU. On the host the same torch code takes a few
milliseconds at these sizes: :func:`build_mask_meta` with ``on_host=True`` (the copy included, to the CPU),
block-sparse path, one thread, measured on a 2-core CPU, median over 3 masks of each kind (1 at 64k):

===========  ========  ========  ===========  ==========  =======  ===========  ======
total_q x k  rand. 16  rand. 40  prefix docs  short docs  stripes  causal docs  window
===========  ========  ========  ===========  ==========  =======  ===========  ======
2k x 2k      1.6 ms    2.4 ms    1.5 ms       1.7 ms      2.4 ms   1.3 ms       1.7 ms
4k x 4k      3.1 ms    5.3 ms    2.2 ms       1.4 ms      4.6 ms   1.5 ms       1.9 ms
2k x 16k     1.9 ms    2.7 ms
5.8k x 5.8k  2.6 ms    5.0 ms    2.8 ms       2.0 ms      6.2 ms   2.2 ms       1.7 ms
8k x 8k      5.8 ms    11 ms     4.4 ms       1.6 ms      8.1 ms   1.5 ms       1.6 ms
16k x 16k    8.7 ms    15 ms     5.8 ms       2.1 ms      16 ms    2.5 ms       3.7 ms
64k x 64k    42 ms     59 ms     15 ms        7.5 ms      45 ms    9.8 ms       11 ms
===========  ========  ========  ===========  ==========  =======  ===========  ======

(rand. n: n random overlapping slices of all four types; prefix docs: causal documents that also see a
shared prefix; short docs: causal documents of 64-200 tokens; stripes: row bands over narrow key bands;
window: a causal sliding window. Masks that take the varlen path, such as packed documents or a sliding
window by default, take 0.1-0.3 ms at every size here.) Up to this size typical masks stay within 2-3 ms;
past it the host time grows with the tile grid (a 1M-token mask has 67M tiles of 128 x 128), which the
device sweeps in parallel."""
_STAGE_ALIGN = 256
"""Byte alignment of each tensor in the staging buffer of the host -> device copy (that of ``cudaMalloc``:
every tensor starts as aligned as if it had been allocated alone)."""
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


def _bst_tables(lists: BlockLists) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """FA4's four block-sparse tensors of ``lists``, int32 on the lists' device: Partial counts
    ``[1, 1, rows]``, Partial index table ``[1, 1, rows, width]``, Full counts, Full index table
    (:meth:`BlockLists.padded`)."""

    def four(t: torch.Tensor) -> torch.Tensor:
        return t.reshape(1, 1, *t.shape).contiguous()

    return (
        four(lists.mask_cnt),
        four(lists.padded(full=False)),
        four(lists.full_cnt),
        four(lists.padded(full=True)),
    )


def _to_bst(tables: tuple[torch.Tensor, ...], block: tuple[int, int]):
    from flash_attn.cute.block_sparsity import BlockSparseTensorsTorch

    mask_cnt, mask_idx, full_cnt, full_idx = tables
    return BlockSparseTensorsTorch(
        mask_block_cnt=mask_cnt,
        mask_block_idx=mask_idx,
        full_block_cnt=full_cnt,
        full_block_idx=full_idx,
        block_size=block,
    )


def r2p_enabled() -> bool:
    """Row-bitmask masking on sm90 forward tiles (``MAGI_FFA_FA4_R2P=0`` falls back to the per-element
    mask_mod everywhere). Read when launch metadata is built; call :func:`clear_launch_cache` after changing it."""
    return env.r2p()


def _mask_mod(width: int, install, plain, r2p):
    # install() is False on a flash-attn-4 release the row-bitmask patch was not written against
    if not r2p_enabled() or not install():
        return plain(width)
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


def metadata_device(total_q: int, total_k: int, device: torch.device) -> torch.device:
    """Where the block-sparse launch metadata of a ``total_q x total_k`` mask meant for ``device`` is built:
    the CPU for a CUDA target when ``total_q * total_k <= HOST_BUILD_MAX_PAIRS`` (the finished tensors then
    travel in one copy, :func:`build_mask_meta`), else ``device`` itself (see :data:`HOST_BUILD_MAX_PAIRS`)."""
    device = torch.device(device)
    if device.type == "cuda" and total_q * total_k <= HOST_BUILD_MAX_PAIRS:
        return torch.device("cpu")
    return device


def _map_tensors(obj, fn, memo: dict[int, object]):
    """``obj`` with every tensor reachable through dataclass fields and plain tuples replaced by
    ``fn(tensor)``. Objects and tensors reached twice (``meta_bwd is meta_fwd``, a varlen group's
    ``seqused_q is lengths_q``) map to one result, so that sharing survives."""
    if id(obj) in memo:
        return memo[id(obj)]
    if isinstance(obj, torch.Tensor):
        out = fn(obj)
    elif type(obj) is tuple:
        out = tuple(_map_tensors(x, fn, memo) for x in obj)
    elif dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        fields = {f.name: getattr(obj, f.name) for f in dataclasses.fields(obj)}
        out = dataclasses.replace(obj, **{k: _map_tensors(v, fn, memo) for k, v in fields.items()})
    else:
        return obj
    memo[id(obj)] = out
    return out


def _staged_to(obj, device: torch.device):
    """``obj`` (see :func:`_map_tensors`) with its tensors on ``device``, moved in one copy: their bytes are
    packed into one staging buffer (pinned for a CUDA target, so that the copy is asynchronous; it is ordered
    on the current stream, as a build on the device would be) and each tensor comes back as a contiguous
    view of one device buffer, with its dtype, shape and values."""
    tensors: dict[int, torch.Tensor] = {}
    _map_tensors(obj, lambda t: tensors.setdefault(id(t), t), {})
    if not tensors:
        return obj
    pad = torch.zeros(_STAGE_ALIGN, dtype=torch.uint8)
    parts: list[torch.Tensor] = []
    starts: dict[int, int] = {}
    size = 0
    for key, t in tensors.items():
        nbytes = t.numel() * t.element_size()
        gap = -nbytes % _STAGE_ALIGN
        starts[key] = size
        parts.append(t.reshape(-1).view(torch.uint8))
        if gap:
            parts.append(pad[:gap])
        size += nbytes + gap
    staging = torch.empty(size, dtype=torch.uint8, pin_memory=device.type == "cuda")
    torch.cat(parts, out=staging)  # one op packs them all
    # the caching host allocator keeps the pinned buffer until the copy has run, so it may be dropped here
    moved = staging.to(device, non_blocking=True)
    typed: dict[torch.dtype, torch.Tensor] = {}  # the whole buffer as each dtype (its size is aligned)

    def view(t: torch.Tensor) -> torch.Tensor:
        if t.dtype not in typed:
            typed[t.dtype] = moved.view(t.dtype)
        first = starts[id(t)] // t.element_size()
        flat = typed[t.dtype][first : first + t.numel()]
        return flat if t.dim() == 1 else flat.view(t.shape)

    return _map_tensors(obj, view, {})


def _build_unmoved(
    q_ranges: torch.Tensor,
    k_ranges: torch.Tensor,
    type_map: torch.Tensor,
    total_q: int,
    total_k: int,
    device: torch.device,
    on_host: bool | None,
) -> tuple[LaunchMeta, bool]:
    """:func:`build_mask_meta` before the transfer: the metadata and whether its tensors are on the host
    and still to be moved to ``device`` (:func:`_staged_to`)."""
    if on_host is None:
        on_host = metadata_device(total_q, total_k, device).type == "cpu" and device.type != "cpu"
    host = None
    if env.varlen() or on_host:
        host = (q_ranges.cpu(), k_ranges.cpu(), type_map.cpu())  # one device -> host read of each table
    if env.varlen():
        slices = host_slices(*host, total_q, total_k)
        # the groups are Python lists turned into tensors: built on the host, they travel in the one copy
        plan = plan_varlen(slices, total_q, total_k, torch.device("cpu"))
        if plan is not None:
            meta = LaunchMeta(
                total_q=total_q, total_k=total_k, width=0, bounds=None, meta_fwd=None, meta_bwd=None,
                fwd_bst=None, bwd_bst=None, mask_mod=None, has_empty_rows=not plan.q_covered, varlen=plan,
            )  # fmt: skip
            return meta, on_host or device.type != "cpu"
    # the intervals and lists are built where the tables are
    q_ranges, k_ranges, type_map = host if on_host else (t.to(device) for t in (q_ranges, k_ranges, type_map))
    iv = row_intervals(q_ranges, k_ranges, type_map, total_q, total_k)
    fwd_block, bwd_block = tile_sizes(device)  # the target's tiles, wherever the lists are built
    meta_fwd = build_block_meta(iv, *fwd_block)
    meta_bwd = meta_fwd if bwd_block == fwd_block else build_block_meta(iv, *bwd_block)
    bounds = interval_bounds(iv, iv.starts.device)
    meta = LaunchMeta(
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
    return meta, on_host


def build_mask_meta(
    q_ranges: torch.Tensor,
    k_ranges: torch.Tensor,
    type_map: torch.Tensor,
    total_q: int,
    total_k: int,
    device: torch.device,
    *,
    on_host: bool | None = None,
) -> LaunchMeta:
    """The mask's part of the launch metadata, without FA4 objects (``fwd_bst``, ``bwd_bst`` and
    ``mask_mod`` are None): FA4 varlen groups when the mask's slices form few of them (and
    ``MAGI_FFA_FA4_VARLEN`` allows), else the interval bounds and block lists. Needs only torch (and
    Triton for the intervals on CUDA); :func:`compile_key` reads it.

    Args:
        q_ranges, k_ranges: int32 ``[num_slices, 2]`` slice ranges; type_map: int32 ``[num_slices]``
            slice types (any device).
        total_q, total_k: query rows and keys.
        device: where the returned tensors live.
        on_host: True builds on the host and moves the finished tensors to ``device`` in one copy (even
            when ``device`` is the CPU), False builds on ``device``; None lets :func:`metadata_device`
            decide. Varlen groups are built on the host either way. The fields are the same either way.
    """
    device = torch.device(device)
    meta, move = _build_unmoved(q_ranges, k_ranges, type_map, total_q, total_k, device, on_host)
    return _staged_to(meta, device) if move else meta


def build_launch_meta(
    q_ranges: torch.Tensor,
    k_ranges: torch.Tensor,
    type_map: torch.Tensor,
    total_q: int,
    total_k: int,
    device: torch.device,
) -> LaunchMeta:
    """Build the launch metadata for ``device``: :func:`build_mask_meta` plus, on the block-sparse path,
    FA4's block-sparse tensors and the interval mask_mod of the bucketed width (imports FA4)."""
    device = torch.device(device)
    meta, move = _build_unmoved(q_ranges, k_ranges, type_map, total_q, total_k, device, None)
    if meta.varlen is not None:
        return _staged_to(meta, device) if move else meta
    from ._fa4_mask import install_r2p_patch, interval_mask_mod, interval_mask_mod_r2p  # imports cutlass

    fwd_block, bwd_block = tile_sizes(device)
    # FA4's index tables are built where the lists are (on the host their width, the longest list, is read
    # without a device round trip) and travel in the same copy
    tables = (_bst_tables(meta.meta_fwd.q2k), _bst_tables(meta.meta_bwd.k2q))
    if move:
        meta, tables = _staged_to((meta, tables), device)
    return dataclasses.replace(
        meta,
        fwd_bst=_to_bst(tables[0], fwd_block),
        bwd_bst=_to_bst(tables[1], bwd_block),
        mask_mod=_mask_mod(meta.width, install_r2p_patch, interval_mask_mod, interval_mask_mod_r2p),
    )


# ----------------------------------------------------------------------------------------------- compile keys
# FA4 keeps one compiled kernel per key of ``flash_attn.cute.interface._flash_attn_fwd`` / ``_flash_attn_bwd``
# (``compile_key``). Besides the problem's configuration (dtype, head dims, heads, softcap, determinism,
# architecture) a key holds, of what a mask changes: the mask function's hash (``utils.hash_callable``: its
# code and captured values, here the interval width), the stride-0 pattern of the block-sparse tensors (never
# their shapes: FA4 accepts compact index tables of any width), the aux tensors' dtype and static strides
# (never their shapes), whether ``seqused`` is given, the causal / window flags, whether a sequence fits one
# backward tile (``single_q_block``, ``single_k_block``) and whether a varlen batch holds more than
# ``BIN_BATCH_SEARCH_THRESH`` (256) entries. What else a key holds depends on the release (``_fa4_version``):
# 4.0.0b36 lists the forward's tile and scheduler choices, among them whether a varlen call's packed longest
# query fits one tile (``is_static_persistent``); 4.0.0b40 keys the resolved ``FwdConfig`` / ``BwdConfig``,
# which on Hopper follow from the configuration and the window kind alone, while on Blackwell the varlen
# forward takes the dynamic persistent scheduler when its entries outnumber its packed query tiles
# (``config.routes_dynamic_varlen``) and the GQA backward folds query heads by a heuristic over the sequence
# lengths, token totals and SM count (``config.select_bwd_fold``).
_FA4_BATCH_SEARCH = 256
_FA4_FWD_TILE_M = 128  # FA4's forward tile rows for head dims up to 128 (sm90 and sm100)


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
    fa4_version: str | None = None,
) -> tuple:
    """The FA4 kernels one call of this mask runs, as a hashable tuple of per-kernel keys (forward, then
    backward; each group of a varlen mask adds its own pair, equal keys once).

    A pure function mirroring what FA4's compile keys read (see the comment above): two masks with equal
    keys run on the same compiled kernels, so a new mask compiles nothing when its key was seen. What a mask
    can change is bounded: the interval width bucket (:func:`width_bucket`), the window kind of a varlen
    group (full, causal, left, right or both sides bounded), whether a sequence fits one tile (at most 128
    tokens; :data:`~magi_ffa_fa4.varlen.SEQLEN_FLOOR` removes it for varlen groups) and whether a varlen
    group holds more than 256 entries. With flash-attn-4 4.0.0b40 on Blackwell (arch 100 / 110) the GQA
    backward of a varlen group also keys the lengths and totals FA4's query-head fold reads (kept whole: an
    upper bound on the kernels it compiles).

    Args:
        meta: launch metadata (:func:`build_mask_meta` or :func:`get_launch_meta`).
        dtype: q's dtype (fp16 / bf16).
        head_dim: q / k / v head dim.
        num_heads_q, num_heads_kv: heads of q and of k / v.
        softcap: > 0 adds FA4's soft-capping score_mod.
        deterministic: the backward's deterministic mode.
        arch: FA4's architecture number (``major * 10 + minor``: 90 Hopper, 100 Blackwell).
        r2p: the row-bitmask forward (default: ``MAGI_FFA_FA4_R2P``, as the launch metadata reads it).
        fa4_version: the flash-attn-4 release whose keys to mirror (default: the installed one, else the
            pinned one); ValueError for a release not in ``_fa4_version.SUPPORTED``.
    """
    version = _fa4_version.resolve(fa4_version)
    config_keyed = version in _fa4_version.CONFIG_KEYED
    r2p = r2p_enabled() if r2p is None else bool(r2p)
    gqa = num_heads_q // num_heads_kv
    blackwell = arch // 10 in (10, 11)
    common = (version, arch, dtype, head_dim, gqa, softcap > 0)
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
    for g in meta.varlen.groups:
        kw = g.fa4_kwargs()
        window = _window_flags(kw)
        used = (kw["seqused_q"] is None, kw["seqused_k"] is None)
        entries = len(g.q_ranges)
        batch_search = entries > _FA4_BATCH_SEARCH
        rows_q = kw["max_seqlen_q"] * gqa  # packed GQA rows of the longest entry
        q_stage = 2 if blackwell and rows_q > _FA4_FWD_TILE_M else 1  # 4.0.0b36's forward stages
        if config_keyed:
            # Blackwell's dynamic varlen route needs more entries than packed query tiles of 256 rows, which
            # varlen.MIN_MEAN_ROWS (256 query rows per entry on average) rules out
            keys[("fwd", "varlen", *common, window, used, batch_search)] = None
        else:
            static = rows_q <= q_stage * _FA4_FWD_TILE_M  # FA4's is_static_persistent for a host max
            keys[("fwd", "varlen", *common, window, used, static, batch_search)] = None
        single = (kw["max_seqlen_q"] <= bwd_m, kw["max_seqlen_k"] <= bwd_n)
        bwd = ("bwd", "varlen", *common, deterministic, window, used, single, batch_search)
        if config_keyed and blackwell and gqa > 1:  # what select_bwd_fold reads
            bwd += (entries, kw["max_seqlen_q"], kw["max_seqlen_k"], meta.total_q, meta.total_k)
        keys[bwd] = None
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


MASKS.limit("fa4", CACHE_SIZE)


def get_launch_meta(
    q_ranges: RangesLike,
    k_ranges: RangesLike,
    attn_type_map: TypeMapLike,
    total_q: int,
    total_k: int,
    device: torch.device,
) -> LaunchMeta:
    """The launch metadata of this mask for ``device``: FA4's data in the mask's entry of the one mask cache
    (``magi_ffa.mask_cache.MASKS``, found by the tables' identity, else their value), built (and the tables
    validated) on a miss. Tables on ``device`` or the CPU, or lists."""
    device = torch.device(device)
    checked = MASKS.lookup(
        (q_ranges, k_ranges, attn_type_map), total_q=total_q, total_k=total_k, device=device
    )
    return launch_meta_of(checked, device)


def launch_meta_of(checked: CheckedSlices, device: torch.device) -> LaunchMeta:
    """The launch metadata of checked slices for ``device``, kept in their entry of the mask cache (at most
    ``MAGI_FFA_FA4_PLAN_CACHE`` masks hold FA4's metadata; the least recently used lose it first). The build
    reads the entry's host tables (varlen planning, small masks' metadata on the host)."""
    device = torch.device(device)

    def build() -> LaunchMeta:
        tables = (checked.q_ranges, checked.k_ranges, checked.types)
        return build_launch_meta(*tables, checked.total_q, checked.total_k, device)

    return MASKS.prepared(checked, ("fa4", str(device)), build)


def clear_launch_cache() -> None:
    """Drop FA4's launch metadata from the mask cache (frees its device tensors; local to this process;
    ``magi_ffa.clear_mask_caches`` empties the whole cache)."""
    MASKS.drop("fa4")
