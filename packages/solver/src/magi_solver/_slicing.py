"""Cutting a rank's slices into host and per-stage slices in local / recv-buffer coordinates."""

from __future__ import annotations

import bisect

import numpy as np

from .dispatch import DispatchPlan
from .mask import band_area_np, clip_region, decompose_region, region_of, tighten_region

__all__ = ["clip_rows", "host_area_of", "merge_full", "slice_over"]


def merge_full(slices: list[tuple[int, int, int, int, int]]) -> list[tuple[int, int, int, int, int]]:
    """Fuse FULL slices with equal q ranges and touching k ranges, then equal k and touching q."""
    full = [s for s in slices if s[4] == 0]
    if len(full) < 2:
        return sorted(slices)
    rest = [s for s in slices if s[4] != 0]
    for key, lo_i, hi_i in (((0, 1), 2, 3), ((2, 3), 0, 1)):
        full.sort(key=lambda s, key=key, lo_i=lo_i: (s[key[0]], s[key[1]], s[lo_i]))
        merged: list[list[int]] = []
        for s in full:
            p = merged[-1] if merged else None
            if p and p[key[0]] == s[key[0]] and p[key[1]] == s[key[1]] and p[hi_i] == s[lo_i]:
                p[hi_i] = s[hi_i]
            else:
                merged.append(list(s))
        full = [tuple(m) for m in merged]  # type: ignore[misc]
    return sorted(full + rest)


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
            cand = sorted({i for c in range(a // cs, b // cs) for i in by_chunk[c]})
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
            r = clip_region((qs, qe, ks, ke, lo, hi), qs, qe, gs, ge)
            if r is None:
                continue
            kd = base - gs
            bucket = out[dest]
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
