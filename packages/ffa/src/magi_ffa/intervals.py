"""Slices -> per-row key intervals (MagiAttention's "HSTU function").

For every query row the visible keys are the union, over the slices containing that row, of one half-open
interval each (global row ``r`` in slice ``(qs, qe, ks, ke, t)``)::

    start = ks + (r - qs      if t has the INV_CAUSAL bit (2) else 0)
    end   = ke - (qe - r - 1  if t has the CAUSAL bit (1) else 0)

(empty when ``start >= end``). The union is stored as sorted, merged, disjoint, non-touching intervals,
padded to the smallest width that holds every row. Memory is O(total_q x width); no dense mask is built.

Two implementations with identical results: :func:`row_intervals_reference` (vectorized torch, any device)
and :func:`row_intervals_triton` (a Triton kernel, rows in blocks; runs under ``TRITON_INTERPRET=1``).
"""

from __future__ import annotations

import torch

from ._common import RangesLike, TypeMapLike, check_slice_values, slices_on_device
from ._row_intervals import RowIntervals

__all__ = ["RowIntervals", "row_intervals", "row_intervals_reference", "slice_row_pairs"]


def slice_row_pairs(
    q_ranges: torch.Tensor, k_ranges: torch.Tensor, type_map: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One candidate interval per (row, slice) incidence, empty ones dropped.

    Returns:
        ``(rows, starts, ends)``, int64 ``[num_pairs]`` each, in slice order (not sorted by row).
    """
    qs, qe = q_ranges[:, 0].long(), q_ranges[:, 1].long()
    ks, ke = k_ranges[:, 0].long(), k_ranges[:, 1].long()
    t = type_map.long()
    inv, cau = (t & 2) != 0, (t & 1) != 0
    # A row's interval length is linear in the row with slope (causal - inverse-causal), so each slice's
    # non-empty rows form one range [r0, r1), found per slice: pairs are then generated for those rows only,
    # with no per-pair filtering, and start / end are linear in the row (``base + slope * row``).
    sk = ke - ks
    r0 = torch.where(cau & ~inv, torch.maximum(qs, qe - sk), qs)  # CAUSAL: the first sq - sk rows see nothing
    r1 = torch.where(inv & ~cau, torch.minimum(qe, qs + sk), qe)  # INV_CAUSAL: rows past qs + sk see nothing
    width = torch.where(inv & cau, sk - (qe - qs) + 1, sk)  # FULL and BI_CAUSAL: one length for every row
    lens = torch.where(width > 0, (r1 - r0).clamp(min=0), 0)
    n = int(lens.sum())
    first = torch.cumsum(lens, 0) - lens  # position of each slice's first pair

    def per_pair(v: torch.Tensor) -> torch.Tensor:
        return torch.repeat_interleave(v, lens, output_size=n)

    i, c = inv.long(), cau.long()
    rows = torch.arange(n, device=qs.device) + per_pair(r0 - first)
    starts = per_pair(ks - i * qs) + rows * per_pair(i)
    ends = per_pair(ke - c * (qe - 1)) + rows * per_pair(c)
    return rows, starts, ends


def _merge_sorted_pairs(
    rows: torch.Tensor, starts: torch.Tensor, ends: torch.Tensor, total_q: int, total_k: int
) -> RowIntervals:
    """Sort (row, start) pairs, merge overlapping/touching intervals per row and pad to a 2-D table."""
    device = rows.device
    if rows.numel() == 0:
        z = torch.zeros(total_q, 1, dtype=torch.int32, device=device)
        return RowIntervals(z, z.clone(), torch.zeros(total_q, dtype=torch.int32, device=device), 1, total_k)
    # lexicographic sort by (row, start) with one key: both fit comfortably in int64; adding row * span keeps
    # rows separate because every start and end lies in [0, total_k], so the key also gives back the row
    span = total_k + 1
    off = rows * span
    key, order = torch.sort(off + starts)
    # segmented running max of `end` within a row: one global cummax is a per-row cummax
    run_max = torch.cummax((off + ends)[order], 0).values
    # a new merged interval starts where the row changes or the start lies past every earlier end
    new = torch.empty_like(key, dtype=torch.bool)
    new[0] = True
    torch.gt(key[1:], run_max[:-1], out=new[1:])
    # masked_select and scatter_ rather than boolean / advanced indexing: the same values, several times
    # less host time on the CPU
    g_key = torch.masked_select(key, new)
    g_rows = g_key // span
    g_base = g_rows * span
    # the merged end is the running max at the last element of each group
    last = torch.empty_like(new)
    last[-1] = True
    last[:-1] = new[1:]
    g_ends = torch.masked_select(run_max, last) - g_base
    counts = torch.bincount(g_rows, minlength=total_q)
    width = max(int(counts.max()), 1)
    first_group = torch.cumsum(counts, 0) - counts
    # flat slot of each merged interval in the [total_q, width] table: its row, then its rank in the row
    flat = torch.arange(g_rows.shape[0], device=device) + (g_rows * width - first_group[g_rows])
    st = torch.zeros(total_q * width, dtype=torch.int32, device=device)
    en = torch.zeros(total_q * width, dtype=torch.int32, device=device)
    st.scatter_(0, flat, (g_key - g_base).to(torch.int32))
    en.scatter_(0, flat, g_ends.to(torch.int32))
    return RowIntervals(
        st.view(total_q, width), en.view(total_q, width), counts.to(torch.int32), width, total_k
    )


def _checked_slices(
    q_ranges: RangesLike, k_ranges: RangesLike, attn_type_map: TypeMapLike, total_q: int, total_k: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The slices as int32 tables on ``q_ranges``' device (the CPU for Python lists), their values checked
    against ``total_q`` / ``total_k`` (ValueError naming the argument)."""
    device = q_ranges.device if isinstance(q_ranges, torch.Tensor) else torch.device("cpu")
    qr, kr, tm = slices_on_device(q_ranges, k_ranges, attn_type_map, device)
    check_slice_values(qr, kr, tm, total_q, total_k)
    return qr, kr, tm


def row_intervals_reference(
    q_ranges: RangesLike,
    k_ranges: RangesLike,
    attn_type_map: TypeMapLike,
    total_q: int,
    total_k: int,
) -> RowIntervals:
    """Vectorized torch reference: O(sum of slice heights) work, O(total_q x width) output.

    Args:
        q_ranges: int32 ``[num_slices, 2]`` query ranges (half-open).
        k_ranges: int32 ``[num_slices, 2]`` key ranges (half-open).
        attn_type_map: int32 ``[num_slices]`` slice types (0..3), ``None`` = all FULL.
        total_q: number of query rows.
        total_k: number of key tokens.
    """
    qr, kr, tm = _checked_slices(q_ranges, k_ranges, attn_type_map, total_q, total_k)
    rows, starts, ends = slice_row_pairs(qr, kr, tm)
    return _merge_sorted_pairs(rows, starts, ends, total_q, total_k)


def row_intervals(
    q_ranges: RangesLike,
    k_ranges: RangesLike,
    attn_type_map: TypeMapLike,
    total_q: int,
    total_k: int,
    *,
    use_triton: bool | None = None,
) -> RowIntervals:
    """Per-row intervals; the Triton kernel on CUDA (or when forced), the torch reference otherwise.

    Args:
        q_ranges, k_ranges, attn_type_map, total_q, total_k: as in :func:`row_intervals_reference`.
        use_triton: force (True) or forbid (False) the Triton kernel; ``None`` picks it on CUDA.
    """
    if use_triton is None:
        use_triton = isinstance(q_ranges, torch.Tensor) and q_ranges.device.type == "cuda"
    if not use_triton:
        return row_intervals_reference(q_ranges, k_ranges, attn_type_map, total_q, total_k)
    from ._intervals_triton import row_intervals_triton

    return row_intervals_triton(
        *_checked_slices(q_ranges, k_ranges, attn_type_map, total_q, total_k), total_q, total_k
    )
