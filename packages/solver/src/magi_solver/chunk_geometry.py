"""What a mask asks of each dispatch chunk: the mask area of its rows (`chunk_areas`, the balance's
weights) and the keys its rows need (`_key_intervals`, `_key_need_matrix`, the communication's). Vectorised
over (slice, chunk) pairs with numpy; slices are validated `(qs, qe, ks, ke, code)` tuples."""

from __future__ import annotations

import numpy as np

from .mask import band_area_np, region_of

__all__ = ["chunk_areas"]


def _region_arrays(slices: list[tuple[int, int, int, int, int]]) -> np.ndarray:
    """int64 `[n, 6]` of (qs, qe, ks, ke, lo, hi)."""
    if not slices:
        return np.zeros((0, 6), dtype=np.int64)
    return np.asarray([region_of(*s) for s in slices], dtype=np.int64)


def _row_chunk_pairs(regs: np.ndarray, chunk_size: int) -> tuple[np.ndarray, np.ndarray]:
    """(region index, chunk id) for every chunk whose rows meet a region's rows."""
    c0 = regs[:, 0] // chunk_size
    c1 = (regs[:, 1] - 1) // chunk_size
    counts = c1 - c0 + 1
    idx = np.repeat(np.arange(len(regs)), counts)
    starts = np.repeat(np.cumsum(counts) - counts, counts)
    chunk = c0[idx] + (np.arange(idx.size) - starts)
    return idx, chunk


def chunk_areas(
    slices: list[tuple[int, int, int, int, int]], total_seqlen: int, chunk_size: int
) -> np.ndarray:
    """int64 `[num_chunks]`: mask area of each chunk's rows (vectorised over (slice, chunk) pairs); a last,
    shorter chunk when `chunk_size` does not divide `total_seqlen` (uneven shards)."""
    num_chunks = -(-total_seqlen // chunk_size)
    regs = _region_arrays(slices)
    out = np.zeros(num_chunks, dtype=np.int64)
    if len(regs) == 0:
        return out
    idx, chunk = _row_chunk_pairs(regs, chunk_size)
    r = regs[idx]
    area = band_area_np(
        np.maximum(r[:, 0], chunk * chunk_size),
        np.minimum(r[:, 1], (chunk + 1) * chunk_size),
        r[:, 2],
        r[:, 3],
        r[:, 4],
        r[:, 5],
    )
    np.add.at(out, chunk, area)
    return out


def _key_intervals(
    slices: list[tuple[int, int, int, int, int]], chunk_size: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Per (slice, chunk) piece with area: (chunk id, q length, key start, key end) of the keys its rows need."""
    regs = _region_arrays(slices)
    if len(regs) == 0:
        z = np.zeros(0, dtype=np.int64)
        return z, z, z, z
    idx, chunk = _row_chunk_pairs(regs, chunk_size)
    qs, qe, ks, ke, lo, hi = (regs[idx, i] for i in range(6))
    a = np.maximum(np.maximum(qs, chunk * chunk_size), ks - hi)
    b = np.minimum(np.minimum(qe, (chunk + 1) * chunk_size), ke - lo)
    kl = np.maximum(ks, a + lo)
    kr = np.minimum(ke, b + hi)
    ok = (a < b) & (kl < kr)
    return chunk[ok], (b - a)[ok], kl[ok], kr[ok]


def _key_need_matrix(
    slices: list[tuple[int, int, int, int, int]], num_chunks: int, chunk_size: int
) -> np.ndarray:
    """float32 `[num_chunks, num_chunks]`: keys of chunk j needed by the rows of chunk i (overlaps add up)."""
    need = np.zeros((num_chunks, num_chunks + 1), dtype=np.float32)
    chunk, _, kl, kr = _key_intervals(slices, chunk_size)
    if chunk.size == 0:
        return need[:, :-1]
    j0, j1 = kl // chunk_size, (kr - 1) // chunk_size
    same = j0 == j1
    np.add.at(need, (chunk[same], j0[same]), (kr - kl)[same])
    diff = ~same
    c, j0, j1, kl, kr = chunk[diff], j0[diff], j1[diff], kl[diff], kr[diff]
    np.add.at(need, (c, j0), (j0 + 1) * chunk_size - kl)
    np.add.at(need, (c, j1), kr - j1 * chunk_size)
    # full middle chunks j0+1 .. j1-1 through a difference array along j
    mid = np.zeros_like(need)
    np.add.at(mid, (c, j0 + 1), chunk_size)
    np.add.at(mid, (c, j1), -chunk_size)
    np.cumsum(mid, axis=1, out=mid)
    need += mid
    del mid
    return need[:, :-1]
