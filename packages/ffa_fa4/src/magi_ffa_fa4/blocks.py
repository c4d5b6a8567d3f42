"""Tile classification (Empty / Partial / Full) and compressed block lists, straight from row intervals.

A tile ``(m, n)`` covers query rows ``[m*block_m, min((m+1)*block_m, total_q))`` and keys
``[n*block_n, min((n+1)*block_n, total_k))`` (tiles at the tails are clipped to the real tokens):

- **Full**: every row of the tile sees every key of the tile: the kernel skips masking.
- **Partial**: some but not all (row, key) pairs are visible: the kernel applies the mask.
- **Empty**: nothing is visible: the kernel never visits the tile.

The classification never builds a dense mask. Per block row it sweeps the interval endpoints: each row
interval adds +1 on the n-blocks it touches and +1 on the n-blocks it covers completely (the intervals of a
row are disjoint and non-touching, so a block is fully covered by one row iff one interval covers it). A
block is Full when the covered count equals the number of valid rows of the tile and Empty when the
touched count is 0. Work is O(E log E) for E interval endpoints plus O(number of non-empty tiles) output;
when the tile grid is no larger than a small multiple of the interval table, the same counts are summed on
the dense grid instead (a bincount and a cumsum, no sort).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from magi_ffa.intervals import RowIntervals, row_intervals

from ._validation import RangesLike, TypeMapLike, check_block

__all__ = [
    "EMPTY",
    "FULL",
    "PARTIAL",
    "BlockLists",
    "BlockSparseMeta",
    "block_classes",
    "build_block_meta",
    "tiles",
]

EMPTY, PARTIAL, FULL = 0, 1, 2


def _cdiv(a: int, b: int) -> int:
    return (a + b - 1) // b


@dataclass(frozen=True, slots=True)
class BlockLists:
    """CSR lists of the non-empty tiles of each block row (forward: rows = m-blocks, entries = n-blocks;
    backward: rows = n-blocks, entries = m-blocks). Entries ascend within a row.

    Attributes:
        full_cnt, mask_cnt: int32 ``[num_rows]``, Full / Partial tiles per row.
        full_offset, mask_offset: int64 ``[num_rows + 1]``, exclusive prefix sums of the counts.
        full_idx, mask_idx: int32 ``[nnz_full]`` / ``[nnz_partial]``, the column block of each tile.
        num_cols: number of blocks along the entry axis.
    """

    full_cnt: torch.Tensor
    full_offset: torch.Tensor
    full_idx: torch.Tensor
    mask_cnt: torch.Tensor
    mask_offset: torch.Tensor
    mask_idx: torch.Tensor
    num_cols: int

    @property
    def num_rows(self) -> int:
        return self.full_cnt.shape[0]

    def padded(self, full: bool) -> torch.Tensor:
        """Index table int32 ``[num_rows, max(1, max count)]``, each row left-packed (FA4's layout)."""
        cnt, off, idx = (
            (self.full_cnt, self.full_offset, self.full_idx)
            if full
            else (self.mask_cnt, self.mask_offset, self.mask_idx)
        )
        width = max(int(cnt.max()) if cnt.numel() else 0, 1)
        table = torch.zeros(self.num_rows, width, dtype=torch.int32, device=cnt.device)
        if idx.numel():
            # the output size is known: without it the device would be read for the sum of the counts
            row = torch.repeat_interleave(
                torch.arange(self.num_rows, device=cnt.device), cnt.long(), output_size=idx.numel()
            )
            pos = torch.arange(idx.numel(), device=cnt.device) - off[row]
            table[row, pos] = idx
        return table


@dataclass(frozen=True, slots=True)
class BlockSparseMeta:
    """Non-empty tiles of a mask on one tile grid, in both directions.

    Attributes:
        block_m, block_n: tile size (query rows x keys).
        num_m, num_n: tile grid size, ``ceil(total_q / block_m)`` x ``ceil(total_k / block_n)``.
        q2k: forward lists (per m-block, the n-blocks to visit).
        k2q: backward lists (per n-block, the m-blocks to visit).
        has_empty_rows: True when some query row sees no key at all (its output must be 0, lse -inf).
    """

    block_m: int
    block_n: int
    num_m: int
    num_n: int
    q2k: BlockLists
    k2q: BlockLists
    has_empty_rows: bool


_DENSE_CELLS_PER_SLOT = 16
""":func:`tiles` sweeps a dense ``num_m x (num_n + 1)`` grid when it has at most this many cells per slot of
the interval table (``total_q x width``): the grid is then about as large as the table it is built from,
and elementwise work, a bincount and a cumsum over it cost a fraction of masking out the padding and sorting
the interval endpoints (16k tokens of 128 x 128 tiles: 16.5k cells). Larger grids over few rows keep the
sort, whose work follows the endpoints."""


def _tiles_dense(
    iv: RowIntervals, valid: torch.Tensor, block_m: int, block_n: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`tiles` on the dense grid: the same +1 / -1 endpoint counts, summed per cell by a bincount and
    swept by a cumsum along each block row; row-major ``nonzero`` lists the tiles in (m, n) order, as the
    sort does. The whole table is swept, padding included: a slot that adds nothing puts its +1 and its -1
    on one cell, which is cheaper than selecting the valid slots first."""
    total_q, total_k = iv.total_q, iv.total_k
    dev = iv.starts.device
    num_m, num_n = _cdiv(total_q, block_m), _cdiv(total_k, block_n)
    stride = num_n + 1
    cells = num_m * stride
    # every key stays below `cells` (and every token index below total_k), so int32 holds them all
    dt = torch.int32 if max(cells, total_k + block_n) < 2**31 else torch.int64
    a, b = iv.starts.to(dt), iv.ends.to(dt)
    base = (torch.arange(total_q, device=dev, dtype=dt) // block_m * stride)[:, None]
    # n-blocks touched: [a // bn, (b - 1) // bn]; fully covered: n*bn >= a and min((n+1)*bn, total_k) <= b
    t_lo = a // block_n
    t_hi = torch.where(valid, (b - 1) // block_n + 1, t_lo)
    f_lo = (a + block_n - 1) // block_n
    f_hi = torch.where(b >= total_k, num_n, b // block_n)
    f_hi = torch.where(valid & (f_hi > f_lo), f_hi, f_lo)

    def count(keys: torch.Tensor) -> torch.Tensor:
        if dev.type == "cpu":
            return torch.bincount(keys, minlength=cells)
        # every key is below `cells`: a scatter into that many counters gives bincount's counts without
        # bincount's device read of the largest key (on the CPU bincount is the faster of the two)
        keys = keys.long()
        return torch.zeros(cells, dtype=torch.int64, device=dev).scatter_add_(0, keys, torch.ones_like(keys))

    def sweep(lo: torch.Tensor, hi: torch.Tensor) -> torch.Tensor:
        d = count((base + lo).flatten())
        d -= count((base + hi).flatten())
        return torch.cumsum(d.view(num_m, stride), 1)[:, :num_n]

    touched, covered = sweep(t_lo, t_hi), sweep(f_lo, f_hi)
    um, un = (touched > 0).nonzero(as_tuple=True)
    rows_in_m = (total_q - torch.arange(num_m, device=dev) * block_m).clamp(max=block_m)
    cls = torch.where(covered[um, un] == rows_in_m[um], FULL, PARTIAL)
    return um, un, cls.to(torch.int8)


def tiles(iv: RowIntervals, block_m: int, block_n: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Non-empty tiles as COO sorted by (m, n).

    Returns:
        ``(m, n, cls)``: int64 ``[nnz]`` block coordinates and int8 ``[nnz]`` classes (1 Partial, 2 Full).
    """
    total_q, total_k = iv.total_q, iv.total_k
    dev = iv.starts.device
    num_n = _cdiv(total_k, block_n)
    empty = torch.zeros(0, dtype=torch.int64, device=dev)
    valid = iv.ends > iv.starts
    if total_q == 0 or total_k == 0 or not bool(valid.any()):
        return empty, empty.clone(), torch.zeros(0, dtype=torch.int8, device=dev)
    if _cdiv(total_q, block_m) * (num_n + 1) <= _DENSE_CELLS_PER_SLOT * valid.numel():
        return _tiles_dense(iv, valid, block_m, block_n)
    # one nonzero for the valid slots (boolean indexing would run one per indexed tensor)
    r, c = valid.nonzero(as_tuple=True)
    a = iv.starts[r, c].long()
    b = iv.ends[r, c].long()
    m = r // block_m
    # n-blocks touched: [a // bn, (b - 1) // bn]; fully covered: n*bn >= a and min((n+1)*bn, total_k) <= b
    t_lo, t_hi = a // block_n, (b - 1) // block_n + 1
    f_lo = (a + block_n - 1) // block_n
    f_hi = torch.where(b >= total_k, num_n, b // block_n)
    f = (f_hi > f_lo).nonzero().flatten()  # the intervals that cover some n-block completely
    stride = num_n + 1
    keys = torch.cat([m * stride + t_lo, m * stride + t_hi, (m * stride + f_lo)[f], (m * stride + f_hi)[f]])
    one, zero = torch.ones_like(a), torch.zeros_like(a)
    one_f, zero_f = one[: f.shape[0]], zero[: f.shape[0]]
    d_t = torch.cat([one, -one, zero_f, zero_f])
    d_f = torch.cat([zero, zero, one_f, -one_f])
    ukeys, inv = torch.unique(keys, sorted=True, return_inverse=True)
    st = torch.zeros(ukeys.shape[0], dtype=torch.int64, device=dev).index_add_(0, inv, d_t)
    sf = torch.zeros(ukeys.shape[0], dtype=torch.int64, device=dev).index_add_(0, inv, d_f)
    # every +1 has its -1 inside the same m-block, so one global cumsum is a per-block sweep
    ct, cf = torch.cumsum(st, 0), torch.cumsum(sf, 0)
    um, un = ukeys // stride, ukeys % stride
    nxt_m = torch.cat([um[1:], torch.full((1,), -1, dtype=um.dtype, device=dev)])
    nxt_n = torch.cat([un[1:], torch.zeros(1, dtype=un.dtype, device=dev)])
    seg_end = torch.where(nxt_m == um, nxt_n, num_n)
    length = (seg_end - un).clamp(min=0)
    rows_in_m = (total_q - um * block_m).clamp(max=block_m)
    cls = torch.where(cf == rows_in_m, FULL, PARTIAL)
    length = torch.where(ct > 0, length, 0)
    seg = torch.repeat_interleave(torch.arange(ukeys.shape[0], device=dev), length)
    first = torch.cumsum(length, 0) - length
    n_out = un[seg] + torch.arange(seg.shape[0], device=dev) - first[seg]
    return um[seg], n_out, cls[seg].to(torch.int8)


def _lists(
    row: torch.Tensor, col: torch.Tensor, cls: torch.Tensor, num_rows: int, num_cols: int
) -> BlockLists:
    """CSR lists from COO sorted by (row, col), rows in ``[0, num_rows)``."""
    out = []
    bounds = torch.arange(num_rows + 1, device=row.device)
    for kind in (FULL, PARTIAL):
        sel = (cls == kind).nonzero().flatten()
        # the rows ascend, so the offsets are where each row starts: no bincount (which reads the largest
        # row back from the device) and no cumsum
        off = torch.searchsorted(row[sel], bounds)
        out += [torch.diff(off).to(torch.int32), off, col[sel].to(torch.int32)]
    return BlockLists(*out, num_cols=num_cols)


def build_block_meta(iv: RowIntervals, block_m: int, block_n: int) -> BlockSparseMeta:
    """Classify every tile of the ``block_m x block_n`` grid and build the q->k and k->q block lists.

    Args:
        iv: per-row intervals of the mask (:func:`magi_ffa.intervals.row_intervals`).
        block_m: tile height in query rows.
        block_n: tile width in keys.
    """
    block_m, block_n = check_block("block_m", block_m), check_block("block_n", block_n)
    num_m, num_n = _cdiv(iv.total_q, block_m), _cdiv(iv.total_k, block_n)
    m, n, cls = tiles(iv, block_m, block_n)
    q2k = _lists(m, n, cls, num_m, num_n)
    order = torch.argsort(n * max(num_m, 1) + m)
    k2q = _lists(n[order], m[order], cls[order], num_n, num_m)
    has_empty_rows = bool((iv.counts == 0).any()) if iv.total_q else False
    return BlockSparseMeta(block_m, block_n, num_m, num_n, q2k, k2q, has_empty_rows)


def block_classes(
    q_ranges: RangesLike,
    k_ranges: RangesLike,
    attn_type_map: TypeMapLike,
    total_q: int,
    total_k: int,
    block_m: int,
    block_n: int,
) -> torch.Tensor:
    """Dense view of the tile classification, for inspection and tests (the kernels use the lists).

    Args:
        q_ranges: int32 ``[num_slices, 2]`` query ranges.
        k_ranges: int32 ``[num_slices, 2]`` key ranges.
        attn_type_map: int32 ``[num_slices]`` slice types (0 FULL, 1 CAUSAL, 2 INV_CAUSAL,
            3 BI_CAUSAL) or None.
        total_q: number of query rows.
        total_k: number of key tokens.
        block_m: tile height (query rows).
        block_n: tile width (keys).

    Returns:
        int8 ``[ceil(total_q / block_m), ceil(total_k / block_n)]``: 0 Empty, 1 Partial, 2 Full.
    """
    block_m, block_n = check_block("block_m", block_m), check_block("block_n", block_n)
    iv = row_intervals(q_ranges, k_ranges, attn_type_map, total_q, total_k)
    m, n, cls = tiles(iv, block_m, block_n)
    out = torch.zeros(
        _cdiv(total_q, block_m), _cdiv(total_k, block_n), dtype=torch.int8, device=iv.starts.device
    )
    out[m, n] = cls
    return out
