"""Triton kernel for slices -> per-row intervals (rows in blocks, runs under ``TRITON_INTERPRET=1``).

One program owns ``BLOCK_R`` consecutive query rows and walks only the slices that touch them (a CSR list
built on the host side with torch, O(number of (row block, slice) incidences)). Each row keeps up to ``CAP``
disjoint, non-touching intervals in registers; inserting an interval merges every interval it overlaps or
touches into one (a single pass suffices because the kept intervals never touch each other) and puts the
result in the first free slot. At the end the slots are ranked by start and written sorted. A row that runs
out of slots raises a flag and the host retries with twice the capacity, so the result never depends on
``CAP``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._row_intervals import RowIntervals

BLOCK_R = 64  # rows per program: 64 x CAP x CAP int32 for the final ranking stays small in registers
CAP_START = 4  # slots per row on the first try (masks in practice need 1-3)
CAP_MAX = 1024


# total_q stays a runtime value: specialising it (== 1, % 16) would compile a variant per token-count class
@triton.jit(do_not_specialize=["total_q"])
def _row_intervals_kernel(
    slice_ptr,  # int32 [num_slices, 5]: q_start, q_end, k_start, k_end, type
    list_ptr,  # int32 [num_incidences]: slice ids, grouped by row block, slice order kept
    list_off_ptr,  # int32 [num_row_blocks + 1]
    starts_ptr,  # int32 [total_q, CAP] out
    ends_ptr,  # int32 [total_q, CAP] out
    counts_ptr,  # int32 [total_q] out; -1 marks a row that overflowed CAP
    total_q,
    BLOCK_R: tl.constexpr,
    CAP: tl.constexpr,
):
    pid = tl.program_id(0)
    rows = pid * BLOCK_R + tl.arange(0, BLOCK_R)
    slot = tl.arange(0, CAP)
    S = tl.zeros([BLOCK_R, CAP], dtype=tl.int32)
    E = tl.zeros([BLOCK_R, CAP], dtype=tl.int32)
    V = tl.zeros([BLOCK_R, CAP], dtype=tl.int32)  # 1 = slot holds an interval
    overflow = tl.zeros([BLOCK_R], dtype=tl.int32)
    lo = tl.load(list_off_ptr + pid)
    hi = tl.load(list_off_ptr + pid + 1)
    for it in range(lo, hi):
        sid = tl.load(list_ptr + it)
        qs = tl.load(slice_ptr + sid * 5 + 0)
        qe = tl.load(slice_ptr + sid * 5 + 1)
        ks = tl.load(slice_ptr + sid * 5 + 2)
        ke = tl.load(slice_ptr + sid * 5 + 3)
        ty = tl.load(slice_ptr + sid * 5 + 4)
        inv = (ty & 2) != 0
        cau = (ty & 1) != 0
        s = ks + tl.where(inv, rows - qs, 0)
        e = ke - tl.where(cau, qe - rows - 1, 0)
        ok = (rows >= qs) & (rows < qe) & (s < e)
        # every kept interval that overlaps or touches [s, e) is absorbed into it
        hit = (V != 0) & (S <= e[:, None]) & (E >= s[:, None]) & ok[:, None]
        ns = tl.minimum(s, tl.min(tl.where(hit, S, 2147483647), axis=1))
        ne = tl.maximum(e, tl.max(tl.where(hit, E, -1), axis=1))
        V = tl.where(hit, 0, V)
        free = tl.min(tl.where(V == 0, slot[None, :], CAP), axis=1)
        overflow = overflow | (ok & (free == CAP)).to(tl.int32)
        put = (slot[None, :] == free[:, None]) & ok[:, None]
        S = tl.where(put, ns[:, None], S)
        E = tl.where(put, ne[:, None], E)
        V = tl.where(put, 1, V)
    # rank each kept interval by start (starts are distinct: the intervals are disjoint)
    before = (V[:, None, :] != 0) & (S[:, None, :] < S[:, :, None])
    rank = tl.sum(before.to(tl.int32), axis=2)
    cnt = tl.sum(V, axis=1)
    row_ok = rows < total_q
    keep = (V != 0) & row_ok[:, None]
    out_off = rows[:, None] * CAP + rank
    tl.store(starts_ptr + out_off, S, mask=keep)
    tl.store(ends_ptr + out_off, E, mask=keep)
    tl.store(counts_ptr + rows, tl.where(overflow != 0, -1, cnt), mask=row_ok)


def _row_block_lists(qr: torch.Tensor, total_q: int) -> tuple[torch.Tensor, torch.Tensor, int]:
    """CSR of slice ids per block of BLOCK_R rows (slice order kept inside a block)."""
    n_blocks = max(triton.cdiv(total_q, BLOCK_R), 1)
    qs, qe = qr[:, 0].long(), qr[:, 1].long()
    nonempty = qe > qs
    b0 = qs // BLOCK_R
    b1 = torch.where(nonempty, (qe - 1) // BLOCK_R, b0 - 1)
    span = (b1 - b0 + 1).clamp(min=0)
    sid = torch.repeat_interleave(torch.arange(qr.shape[0], device=qr.device), span)
    first = torch.cumsum(span, 0) - span
    blk = b0[sid] + torch.arange(sid.shape[0], device=qr.device) - first[sid]
    order = torch.sort(blk, stable=True).indices
    lst = sid[order].to(torch.int32)
    off = torch.zeros(n_blocks + 1, dtype=torch.int64, device=qr.device)
    off[1:] = torch.cumsum(torch.bincount(blk, minlength=n_blocks), 0)
    return lst.contiguous(), off.to(torch.int32), n_blocks


def row_intervals_triton(
    qr: torch.Tensor, kr: torch.Tensor, tm: torch.Tensor, total_q: int, total_k: int
) -> RowIntervals:
    """:func:`magi_ffa.intervals.row_intervals` via the Triton kernel, on slices already checked there
    (int32 ``[n, 2]``, ``[n, 2]``, ``[n]`` on one device; the result is on it)."""
    device = qr.device
    if total_q == 0:
        z = torch.zeros(0, 1, dtype=torch.int32, device=device)
        return RowIntervals(z, z.clone(), torch.zeros(0, dtype=torch.int32, device=device), 1, total_k)
    table = torch.cat([qr, kr, tm[:, None]], dim=1).contiguous()
    lst, off, n_blocks = _row_block_lists(qr, total_q)
    if lst.numel() == 0:
        lst = torch.zeros(1, dtype=torch.int32, device=device)  # never read: every block range is empty
        table = torch.zeros(1, 5, dtype=torch.int32, device=device)
    cap = CAP_START
    while True:
        starts = torch.zeros(total_q, cap, dtype=torch.int32, device=device)
        ends = torch.zeros(total_q, cap, dtype=torch.int32, device=device)
        counts = torch.empty(total_q, dtype=torch.int32, device=device)
        _row_intervals_kernel[(n_blocks,)](
            table, lst, off, starts, ends, counts, total_q, BLOCK_R=BLOCK_R, CAP=cap, num_warps=4
        )
        lo_hi = torch.stack([counts.min(), counts.max()]).tolist()
        if lo_hi[0] >= 0:
            break
        if cap >= CAP_MAX:
            raise ValueError(f"a query row needs more than {CAP_MAX} disjoint key intervals; not supported")
        cap *= 2
    width = max(lo_hi[1], 1)
    return RowIntervals(starts[:, :width].contiguous(), ends[:, :width].contiguous(), counts, width, total_k)
