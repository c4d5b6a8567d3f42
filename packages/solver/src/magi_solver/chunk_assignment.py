"""The chunk-assignment algorithms of the dispatch: chunk ids to ranks, from the chunks' areas (and, for
affinity, the keys their rows need). Each returns per rank a list of chunk ids; every rank holds
`n // cp_size` chunks and, with uneven shards, `n % cp_size` ranks hold one more. `dispatch_lower_bound` is
the bound they are measured against. `magi_solver.dispatch.dispatch_slices` picks one by `DispatchAlg`."""

from __future__ import annotations

import heapq
from typing import Any

import numpy as np

from .chunk_geometry import _key_need_matrix

__all__ = ["dispatch_lower_bound"]


def dispatch_lower_bound(areas: Any, cp_size: int) -> int:
    """Lower bound on the max rank load of any assignment where every rank holds at least
    `m = len(areas) // cp_size` chunks (equal counts, or uneven shards' counts that differ by one).

    Two bounds: the mean load (rounded up), and the largest chunk plus the `m - 1` smallest other chunks
    (its rank holds `m - 1` more chunks).
    """
    a = np.sort(np.asarray(areas, dtype=np.int64).ravel())  # exact: areas are int64 everywhere
    if not a.size:
        return 0
    m = a.size // cp_size
    mean_bound = -(-int(a.sum()) // cp_size)
    return max(mean_bound, int(a[-1]) + int(a[: m - 1].sum()))


def _min_heap(areas: list[int], cp_size: int, refine: bool = True) -> list[list[int]]:
    """Largest chunk first to the least-loaded rank with room. Every rank holds `n // cp_size` chunks and,
    when `cp_size` does not divide `n` (uneven shards), `n % cp_size` ranks hold one more."""
    base, extra = divmod(len(areas), cp_size)
    cap = base + (extra > 0)
    order = sorted(range(len(areas)), key=lambda c: (-areas[c], c))
    heap = [(0, r) for r in range(cp_size)]
    parts: list[list[int]] = [[] for _ in range(cp_size)]
    for c in order:
        load, r = heapq.heappop(heap)  # ranks at `cap` are never pushed back
        while len(parts[r]) >= base and extra == 0:  # at `base` once every extra slot is taken: full
            load, r = heapq.heappop(heap)
        parts[r].append(c)
        if len(parts[r]) > base:
            extra -= 1
        if len(parts[r]) < cap:
            heapq.heappush(heap, (load + areas[c], r))
    if refine and cp_size > 1:
        _refine_swaps(areas, parts)
    return parts


_REFINE_MAX_PAIRS = 1 << 22  # entries of the [m, cp, m] swap table per round (32 MiB)
_REFINE_CLOSE_ENOUGH = 1e-4  # relative gap to the lower bound at which the swaps stop


def _refine_swaps(areas: list[int], parts: list[list[int]], max_rounds: int | None = None) -> None:
    """Swap one chunk of the most-loaded rank with one chunk of another rank while both end strictly below
    the old maximum (so the max load never grows); pick the swap that best halves the gap. In place.

    Chunk counts that differ by one (uneven shards) are padded with an empty slot (a sentinel chunk of area
    0) on the ranks holding fewer: a swap with an empty slot moves a chunk from a rank holding more to a
    rank holding fewer, which keeps the counts within one; the other moves through empty slots are masked.
    """
    n = len(areas)
    width = max(len(p) for p in parts)
    a = np.asarray([*areas, 0], dtype=np.int64)  # index n: the empty slot
    mat = np.full((len(parts), width), n, dtype=np.int64)  # [cp, m] chunk ids
    for r, p in enumerate(parts):
        mat[r, : len(p)] = p
    if mat.shape[1] ** 2 * mat.shape[0] > _REFINE_MAX_PAIRS:
        return  # one round would build too large a table; the greedy result stands
    ragged = bool((mat == n).any())
    loads = a[mat].sum(axis=1)
    # within 1e-4 of the lower bound no swap can help enough to pay for another round of the table
    good_enough = dispatch_lower_bound(areas, len(parts)) * (1.0 + _REFINE_CLOSE_ENOUGH)
    for _ in range(max_rounds or 4 * len(parts)):
        if loads.max() <= good_enough:
            break
        top = int(np.argmax(loads))
        gap = loads[top] - loads  # per rank: how much the top rank is above it
        d = a[mat[top]][:, None, None] - a[mat][None, :, :]  # [m(top), cp, m]: area moved top -> rank
        ok = (d > 0) & (d < gap[None, :, None])
        if ragged:
            real = mat != n
            # the top rank gives a real chunk; it may land in an empty slot only if the top rank holds more
            ok &= real[top][:, None, None] & (real[None, :, :] | bool(real[top].all()))
        if not ok.any():
            break
        # best: the new max of the pair, max(top - d, rank + d), as small as possible
        cost = np.where(ok, np.maximum(loads[top] - d, loads[None, :, None] + d), np.iinfo(np.int64).max)
        i, r, j = np.unravel_index(int(np.argmin(cost)), cost.shape)
        mat[top, i], mat[r, j] = mat[r, j], mat[top, i]
        loads[top] -= d[i, r, j]
        loads[r] += d[i, r, j]
    for r in range(len(parts)):
        parts[r] = [int(c) for c in mat[r] if c != n]


def _sequential(num_chunks: int, cp_size: int) -> list[list[int]]:
    """Contiguous blocks; with uneven shards the first `num_chunks % cp_size` ranks hold one chunk more."""
    base, extra = divmod(num_chunks, cp_size)
    starts = [r * base + min(r, extra) for r in range(cp_size + 1)]
    return [list(range(starts[r], starts[r + 1])) for r in range(cp_size)]


def _zigzag(num_chunks: int, cp_size: int, uneven_shard: bool = False) -> list[list[int]]:
    if uneven_shard:
        # 2*cp contiguous blocks whose sizes differ by at most one (the first ones larger); rank r takes
        # blocks r and 2*cp-1-r, so chunk counts differ by at most one and no rank is empty
        starts = _sequential(num_chunks, 2 * cp_size)
        return [starts[r] + starts[2 * cp_size - 1 - r] for r in range(cp_size)]
    per = num_chunks // cp_size
    if per % 2:
        raise ValueError(
            f"alg='zigzag' needs an even number of chunks per rank, got {per} (num_chunks {num_chunks}, "
            f"cp_size {cp_size}); halve `chunk_size`"
        )
    h = per // 2
    return [
        list(range(r * h, (r + 1) * h)) + list(range((2 * cp_size - 1 - r) * h, (2 * cp_size - r) * h))
        for r in range(cp_size)
    ]


_AFFINITY_MAX_CHUNKS = 4096  # float32 table of 64 MiB


def _affinity(
    areas: list[int],
    cp_size: int,
    slices: list[tuple[int, int, int, int, int]],
    chunk_size: int,
    tolerance: float,
) -> list[list[int]]:
    """Largest chunk first; among ranks with room whose load stays within `(1 + tolerance) * lower bound`,
    take the one with the most affinity (keys its rows need, or rows that need its keys); with no such rank,
    or no affinity anywhere, the least-loaded rank (MIN_HEAP's choice)."""
    n = len(areas)
    base, extra = divmod(n, cp_size)  # counts: base each, `extra` ranks one more (uneven shards)
    if n > _AFFINITY_MAX_CHUNKS:
        raise ValueError(
            f"alg='affinity' keeps a num_chunks x num_chunks affinity table; {n} chunks is more than "
            f"{_AFFINITY_MAX_CHUNKS}: use a larger `chunk_size` or alg='min_heap'"
        )
    need = np.ascontiguousarray(_key_need_matrix(slices, n, chunk_size))
    sym = need + need.T
    aff = np.zeros((cp_size, n), dtype=np.float32)
    loads = np.zeros(cp_size, dtype=np.int64)
    counts = np.zeros(cp_size, dtype=np.int64)
    target = dispatch_lower_bound(areas, cp_size) * (1.0 + tolerance)
    parts: list[list[int]] = [[] for _ in range(cp_size)]
    for c in sorted(range(n), key=lambda c: (-areas[c], c)):
        open_ranks = np.flatnonzero((counts < base) | ((counts == base) & (extra > 0)))
        fits = open_ranks[loads[open_ranks] + areas[c] <= target]
        score = aff[fits, c] if fits.size else np.zeros(0, dtype=np.float32)
        if fits.size and score.max() > 0:
            best = fits[score == score.max()]
        else:
            best = open_ranks
        r = int(best[np.argmin(loads[best])])  # least loaded among the best (then lowest id)
        parts[r].append(c)
        counts[r] += 1
        extra -= int(counts[r] > base)
        loads[r] += areas[c]
        aff[r] += sym[c]
    # the greedy keeps every rank within the bound while it can; the last, smallest chunks may still land
    # above it: swaps of one chunk (the ones min-heap refines with) restore the balance
    if cp_size > 1:
        _refine_swaps(areas, parts)
        # then swaps that lower the busiest fetcher's remote keys without raising the balanced maximum
        _comm_swaps(need, areas, parts, max(sum(areas[c] for c in p) for p in parts))
    # The greedy can lose to plain min-heap on both counts (e.g. block-causal video, where every late block
    # needs every earlier one): then min-heap's assignment is strictly better, so return it.
    heap = _min_heap(areas, cp_size)
    if _estimated_comm(need, heap) <= _estimated_comm(need, parts):
        return heap
    return parts


_COMM_SWAP_CANDIDATES = 64
"""Chunks of other ranks a comm swap considers per round (those that add the fewest remote keys)."""


def _needs_top2(need: np.ndarray, chunks: list[int]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per key chunk: the largest and second largest need of `chunks`' rows, and the chunk with the largest."""
    rows = need[chunks]
    arg = rows.argmax(axis=0)
    cols = np.arange(rows.shape[1])
    top1 = rows[arg, cols]
    if len(chunks) > 1:
        rest = rows.copy()
        rest[arg, cols] = -1.0
        top2 = rest.max(axis=0)
    else:
        top2 = np.zeros_like(top1)
    return top1, np.maximum(top2, 0.0), np.asarray(chunks, dtype=np.int64)[arg]


def _comm_swaps(need: np.ndarray, areas: list[int], parts: list[list[int]], cap: int) -> None:
    """Swap one chunk of the rank with the most estimated remote keys (`_estimated_comm`'s per-rank term)
    with one chunk of another rank while the larger estimate of the two ends below the old maximum and both
    loads stay within `cap` (so the balance never gets worse); at most `2 * cp` swaps. In place.

    The balancing swaps ignore affinity and scatter a long document's chunks over more ranks than the
    balance needs; these swaps bring the chunks its busiest fetcher needs back to it. Each round scores the
    other ranks' chunks by the keys they would add to that rank, and prices the `_COMM_SWAP_CANDIDATES`
    best against each of the rank's chunks exactly (both ranks' estimates after the swap)."""
    n, cp = need.shape[0], len(parts)
    area = np.asarray(areas, dtype=np.int64)
    owner = np.empty(n, dtype=np.int64)
    for r, p in enumerate(parts):
        owner[p] = r
    loads = np.asarray([area[p].sum() for p in parts], dtype=np.int64)
    tops = [_needs_top2(need, p) for p in parts]
    nz_r, nz_c = np.nonzero(need)  # the candidates' scores walk the needs that are there (few for documents)
    nz_v = need[nz_r, nz_c]
    comms = np.asarray([float(t[0].sum() - t[0][p].sum()) for t, p in zip(tops, parts)])
    for _ in range(2 * cp):
        r = int(np.argmax(comms))
        P = np.asarray(parts[r], dtype=np.int64)
        top1, top2, arg1 = tops[r]
        own = owner == r
        # b's from other ranks that add the fewest keys to r's estimate (b's own column becomes owned)
        add = np.where(own[nz_c] | (nz_r == nz_c), 0.0, np.maximum(nz_v - top1[nz_c], 0.0))
        delta = np.bincount(nz_r, add, minlength=n) - top1
        delta[own] = np.inf
        k = min(_COMM_SWAP_CANDIDATES, n - P.size)
        if k <= 0:
            break
        B = np.argpartition(delta, k - 1)[:k]
        S = owner[B]
        mi, bi = np.arange(P.size)[:, None], np.arange(B.size)[None, :]
        rows_p, rows_b = need[P], need[B]
        # max(x, y) = x + max(0, y - x): the second term only where an added chunk needs keys (`cols`)
        cols = np.flatnonzero((rows_p > 0).any(axis=0) | (rows_b > 0).any(axis=0))
        # r gives a (rows of P), takes b: its column of a is no longer owned, b's is
        wo_a = np.where(arg1[None, :] == P[:, None], top2[None, :], top1[None, :])  # [m, n]
        extra = np.maximum(rows_b[None, :, cols] - wo_a[:, None, cols], 0.0)  # [m, k, J]
        base = np.where(own, 0.0, wo_a).sum(axis=1)[:, None]
        comm_r = base + np.where(own[cols], 0.0, extra).sum(axis=2)
        comm_r += np.maximum(wo_a[mi, P[:, None]], rows_b[bi, P[:, None]])  # a's column
        comm_r -= np.maximum(wo_a[mi, B[None, :]], rows_b[bi, B[None, :]])  # b's column
        # s (b's owner) gives b, takes a
        s1 = np.stack([tops[x][0] for x in S.tolist()])
        s2 = np.stack([tops[x][1] for x in S.tolist()])
        sa = np.stack([tops[x][2] for x in S.tolist()])
        wo_b = np.where(sa == B[:, None], s2, s1)  # [k, n]
        own_s = owner[None, :] == S[:, None]  # [k, n]
        extra = np.maximum(rows_p[:, None, cols] - wo_b[None, :, cols], 0.0)  # [m, k, J]
        base = np.where(own_s, 0.0, wo_b).sum(axis=1)[None, :]
        comm_s = base + np.where(own_s[None, :, cols], 0.0, extra).sum(axis=2)
        comm_s += np.maximum(wo_b[bi, B[None, :]], rows_p[mi, B[None, :]])  # b's column
        comm_s -= np.maximum(wo_b[bi, P[:, None]], rows_p[mi, P[:, None]])  # a's column
        moved = area[P][:, None] - area[B][None, :]
        ok = (loads[r] - moved <= cap) & (loads[S][None, :] + moved <= cap)
        worst = np.where(ok, np.maximum(comm_r, comm_s), np.inf)
        i, j = np.unravel_index(int(np.argmin(worst)), worst.shape)
        if not worst[i, j] < comms[r] - 0.5:  # estimates count tokens: at least one fewer, or stop
            break
        a, b, s = int(P[i]), int(B[j]), int(S[j])
        parts[r][parts[r].index(a)] = b
        parts[s][parts[s].index(b)] = a
        owner[a], owner[b] = s, r
        loads[r] -= moved[i, j]
        loads[s] += moved[i, j]
        for x in (r, s):
            tops[x] = _needs_top2(need, parts[x])
            comms[x] = float(tops[x][0].sum() - tops[x][0][parts[x]].sum())


def _estimated_comm(need: np.ndarray, parts: list[list[int]]) -> float:
    """Max over ranks of the remote keys it fetches, at chunk granularity: for each chunk it does not hold,
    the most keys any of its own chunks needs from it (key sets of one document's rows nest)."""
    worst = 0.0
    own = np.zeros(need.shape[1], dtype=bool)
    for p in parts:
        own[:] = False
        own[p] = True
        worst = max(worst, float(need[p].max(axis=0)[~own].sum()))
    return worst
