"""Cutting a rank's slices into host and per-stage slices in local / recv-buffer coordinates."""

from __future__ import annotations

import bisect

import numpy as np

from .dispatch import DispatchPlan
from .mask import band_area_np, clip_region, decompose_region, region_of, tighten_region

__all__ = ["clip_rows", "host_area_of", "merge_full", "slice_over"]


def merge_full(slices: list[tuple[int, int, int, int, int]]) -> list[tuple[int, int, int, int, int]]:
    """Fuse FULL slices with equal q ranges and touching k ranges, then equal k and touching q.

    Output is sorted by (q start, q end, k start); other types pass through unchanged.
    """
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
    pieces into typed slices in local q and destination k coordinates; destination -1 (host) goes last."""
    starts = [m[0] for m in kmap]
    for qs, qe, ks, ke, lo, hi, qoff in clipped:
        j = max(bisect.bisect_right(starts, ks) - 1, 0)
        while j < len(kmap) and kmap[j][0] < ke:
            gs, ge, dest, base = kmap[j]
            j += 1
            if ge <= ks:
                continue
            kd = base - gs
            bucket = out[dest]
            a, b = max(ks, gs), min(ke, ge)
            if a - qe + 1 >= lo and b - 1 - qs <= hi:  # the band cuts nothing here: a FULL rectangle
                p = bucket[-1] if bucket else None
                if p and p[4] == 0 and p[0] == qs + qoff and p[1] == qe + qoff and p[3] == a + kd:
                    bucket[-1] = (p[0], p[1], p[2], b + kd, 0)  # extends the previous piece
                else:
                    bucket.append((qs + qoff, qe + qoff, a + kd, b + kd, 0))
                continue
            r = clip_region((qs, qe, ks, ke, lo, hi), qs, qe, gs, ge)
            if r is None:
                continue
            for a, b, c, d, t in decompose_region(r):
                bucket.append((a + qoff, b + qoff, c + kd, d + kd, t))


def host_area_of(clipped: list[tuple[int, ...]], kmap: list[tuple[int, int, int, int]]) -> int:
    """Exact area of the clipped regions inside the key map's ranges (the host ranges)."""
    if not clipped:
        return 0
    reg = np.asarray([c[:6] for c in clipped], dtype=np.int64)
    gs = np.asarray([m[0] for m in kmap], dtype=np.int64)[None, :]
    ge = np.asarray([m[1] for m in kmap], dtype=np.int64)[None, :]
    qs, qe, ks, ke, lo, hi = (reg[:, i : i + 1] for i in range(6))
    return int(band_area_np(qs, qe, np.maximum(ks, gs), np.minimum(ke, ge), lo, hi).sum())
