"""Cutting a rank's slices into host and per-stage slices in local / recv-buffer coordinates."""

from __future__ import annotations

import numpy as np

from .dispatch import DispatchPlan
from .mask import band_area_np, clip_region, decompose_region, region_of, tighten_region

__all__ = ["clip_rows", "host_area_of", "merge_full", "slice_over"]


_NUMPY_MIN = 64
"""From this many slices on, `merge_full` runs on arrays (below it, numpy's per-call cost dominates)."""


def _fuse(x: np.ndarray) -> np.ndarray:
    """Rows (a, b, c, d) sorted lexicographically: fuse runs with equal (a, b) whose [c, d) touch."""
    brk = np.ones(len(x), dtype=bool)
    brk[1:] = (x[1:, 0] != x[:-1, 0]) | (x[1:, 1] != x[:-1, 1]) | (x[1:, 2] != x[:-1, 3])
    starts = np.flatnonzero(brk)
    ends = np.append(starts[1:], len(x)) - 1
    out = x[starts].copy()
    out[:, 3] = x[ends, 3]
    return out


def _merge_full_np(slices: list[tuple[int, int, int, int, int]]) -> list[tuple[int, int, int, int, int]]:
    arr = np.asarray(slices, dtype=np.int64)
    full = arr[arr[:, 4] == 0, :4]
    rest = arr[arr[:, 4] != 0]
    if len(full) > 1:
        full = full[np.lexsort(full.T[::-1])]
        full = _fuse(full)  # equal q, touching k
        by_k = full[:, [2, 3, 0, 1]]
        by_k = by_k[np.lexsort(by_k.T[::-1])]
        full = _fuse(by_k)[:, [2, 3, 0, 1]]  # equal k, touching q
    both = np.concatenate([np.column_stack([full, np.zeros(len(full), np.int64)]), rest])
    both = both[np.lexsort(both.T[::-1])]
    return list(map(tuple, both.tolist()))


def merge_full(slices: list[tuple[int, int, int, int, int]]) -> list[tuple[int, int, int, int, int]]:
    """Fuse FULL slices with equal q ranges and touching k ranges, then equal k and touching q.

    Output is sorted by (q start, q end, k start); other types pass through unchanged.
    """
    if len(slices) >= _NUMPY_MIN:
        return _merge_full_np(slices)
    full = sorted(s[:4] for s in slices if s[4] == 0)  # (qs, qe, ks, ke): native tuple order
    rest = [s for s in slices if s[4] != 0]
    if len(full) > 1:
        merged: list[tuple[int, int, int, int]] = []
        for s in full:
            if merged:
                p = merged[-1]
                if p[0] == s[0] and p[1] == s[1] and p[3] == s[2]:
                    merged[-1] = (p[0], p[1], p[2], s[3])
                    continue
            merged.append(s)
        by_k = sorted((c, d, a, b) for a, b, c, d in merged)  # (ks, ke, qs, qe)
        merged2: list[tuple[int, int, int, int]] = []
        for s in by_k:
            if merged2:
                p = merged2[-1]
                if p[0] == s[0] and p[1] == s[1] and p[3] == s[2]:
                    merged2[-1] = (p[0], p[1], p[2], s[3])
                    continue
            merged2.append(s)
        full = [(a, b, c, d) for c, d, a, b in merged2]
    out = [(a, b, c, d, 0) for a, b, c, d in full]
    out.extend(rest)
    out.sort()
    return out


def clip_rows(
    dispatch: DispatchPlan, slices: list[tuple[int, int, int, int, int]]
) -> list[list[tuple[int, ...]]]:
    """Per rank: its slices clipped to its rows, as tightened regions plus the q offset global -> local."""
    cs = dispatch.chunk_size
    by_chunk: list[list[int]] = [[] for _ in range(dispatch.num_chunks)]
    regions = []
    for s in slices:
        r = tighten_region(*region_of(*s))
        if r is None:
            continue
        i = len(regions)
        regions.append(r)
        for c in range(r[0] // cs, (r[1] - 1) // cs + 1):
            by_chunk[c].append(i)
    out = []
    for rank in range(dispatch.cp_size):
        clipped: list[tuple[int, ...]] = []
        local = 0
        for a, b in dispatch.host_pairs(rank):
            # -(-b // cs): an uneven shard's last chunk ends at total_seqlen, not at a chunk boundary
            cand = sorted({i for c in range(a // cs, -(-b // cs)) for i in by_chunk[c]})
            for i in cand:
                r = clip_region(regions[i], a, b, regions[i][2], regions[i][3])
                if r is not None:
                    clipped.append((*r, local - a))
            local += b - a
        out.append(clipped)
    return out


def slice_over(
    clipped: list[tuple[int, ...]], kmap: list[tuple[int, int, int, int]], out: list[list[tuple[int, ...]]]
) -> None:
    """Cut each clipped region by the key map (sorted global ranges -> (destination, base)); decompose the
    pieces into typed slices in local q and destination k coordinates; destination -1 (host) goes last.

    Pieces are appended unmerged (the callers' `merge_full` fuses touching FULL pieces). Vectorised over
    (region, key range) pairs: the pieces the band does not cut are FULL rectangles, emitted from arrays;
    only the few pairs the band's edge crosses are decomposed one by one.
    """
    if not clipped or not kmap:
        return
    reg = np.asarray(clipped, dtype=np.int64)
    km = np.asarray(kmap, dtype=np.int64)
    gs, ge = km[:, 0], km[:, 1]
    qs, qe, ks, ke, lo, hi, qoff = (reg[:, i] for i in range(7))
    j0 = np.maximum(np.searchsorted(gs, ks, side="right") - 1, 0)
    j1 = np.searchsorted(gs, ke, side="left")  # key ranges starting before the region's keys end
    counts = np.maximum(j1 - j0, 0)
    idx = np.repeat(np.arange(len(reg)), counts)
    first = np.repeat(np.cumsum(counts) - counts, counts)
    j = j0[idx] + (np.arange(idx.size) - first)
    a = np.maximum(ks[idx], gs[j])
    b = np.minimum(ke[idx], ge[j])
    meet = b > a
    idx, j, a, b = idx[meet], j[meet], a[meet], b[meet]
    full = (a - qe[idx] + 1 >= lo[idx]) & (b - 1 - qs[idx] <= hi[idx])  # the band cuts nothing here
    dest = km[j, 2]
    kd = km[j, 3] - gs[j]
    dest_slot = np.where(dest < 0, len(out) - 1, dest)
    f = np.flatnonzero(full)
    if f.size:
        i = idx[f]
        rows = np.stack(
            [qs[i] + qoff[i], qe[i] + qoff[i], a[f] + kd[f], b[f] + kd[f], np.zeros(f.size, np.int64)], axis=1
        )
        slot = dest_slot[f]
        order = np.argsort(slot, kind="stable")
        rows, slot = rows[order], slot[order]
        cuts = np.flatnonzero(np.diff(slot)) + 1
        for part, d in zip(np.split(rows, cuts), slot[np.concatenate([[0], cuts])].tolist()):
            out[d].extend(map(tuple, part.tolist()))
    for p in np.flatnonzero(~full).tolist():
        i, jj = int(idx[p]), int(j[p])
        r = clip_region(tuple(int(x) for x in reg[i, :6]), int(qs[i]), int(qe[i]), int(gs[jj]), int(ge[jj]))
        if r is None:
            continue
        o, k_shift, bucket = int(qoff[i]), int(kd[p]), out[int(dest_slot[p])]
        for qa, qb, kc, kdd, t in decompose_region(r):
            bucket.append((qa + o, qb + o, kc + k_shift, kdd + k_shift, t))


def host_area_of(clipped: list[tuple[int, ...]], kmap: list[tuple[int, int, int, int]]) -> int:
    """Exact area of the clipped regions inside the key map's ranges (the host ranges)."""
    if not clipped:
        return 0
    reg = np.asarray([c[:6] for c in clipped], dtype=np.int64)
    gs = np.asarray([m[0] for m in kmap], dtype=np.int64)[None, :]
    ge = np.asarray([m[1] for m in kmap], dtype=np.int64)[None, :]
    qs, qe, ks, ke, lo, hi = (reg[:, i : i + 1] for i in range(6))
    return int(band_area_np(qs, qe, np.maximum(ks, gs), np.minimum(ke, ge), lo, hi).sum())
