"""The documents placement's orientation pass: a cut unit's short pieces first, where its keys are few.

A rank holding rows of a causal unit needs every key of the unit before its last row. A unit cut between
ranks therefore costs the rank holding the later piece the whole earlier piece in received keys: a cut at
chunk p of the unit costs p chunks of keys. A fill that lets a unit straddle a rank boundary with a small
remainder on one side costs little only when that remainder is the unit's *first* rows; when it is the last
rows, the remainder's rank receives almost the whole unit. `oriented` keeps every rank's chunk count inside
every unit and only reorders the unit's chunks among its ranks: the ranks holding fewer of its chunks get its
earlier rows, as contiguous runs (the order that receives the fewest keys for those counts).

The reordered rows move tiles between the ranks (the later rows are the costlier ones), so the placement
(`documents._best_fill`) offers its pick reordered whole and reordered unit by unit where no rank gets
slower (`oriented_where_no_worse`), each after the local repair, and the law's exact price decides.
"""

from __future__ import annotations

import numpy as np

from .documents_repair import ChunkTables, _State

__all__ = ["oriented", "oriented_where_no_worse"]


def oriented(
    owner: np.ndarray, units: np.ndarray, cp: int, most: int = 2, skip: np.ndarray | None = None
) -> np.ndarray:
    """A copy of `owner` where each unit held by 2 ..
    `most` ranks has its chunks reordered among those ranks: each rank keeps its count of the unit's chunks,
    now as one contiguous run, the ranks holding fewer first (ties: the rank that held the unit's earliest
    chunk first).

    Args:
        owner: int64 `[n]`, the rank of each chunk.
        units: int64 `[u + 1]`, the units' chunk boundaries (0, ..., n).
        cp: ranks.
        most: units held by more ranks than this are left as they are (a long unit's time-sized pieces
            are shorter towards its end on purpose: its later rows are costlier).
        skip: bool `[u]`, units left as they are whatever their holders.

    Returns:
        int64 `[n]`: the reordered owners (every rank's chunk count kept, per unit too).
    """
    n = owner.size
    out = owner.copy()
    if n == 0 or units.size < 2:
        return out
    unit_of = np.repeat(np.arange(units.size - 1, dtype=np.int64), np.diff(units))
    key = unit_of * cp + owner
    uk, first, counts = np.unique(key, return_index=True, return_counts=True)
    u = uk // cp
    holders = np.bincount(u, minlength=units.size - 1)
    ok = (holders[u] >= 2) & (holders[u] <= most)
    if skip is not None:
        ok &= ~skip[u]
    multi = np.flatnonzero(ok)
    if multi.size == 0:
        return out
    # per unit: its (rank, count, first chunk) rows are consecutive in `uk` (sorted by unit, then rank)
    starts = multi[np.r_[True, u[multi[1:]] != u[multi[:-1]]]]
    for s in starts.tolist():
        k = int(holders[u[s]])
        rows = sorted(
            zip(counts[s : s + k].tolist(), first[s : s + k].tolist(), (uk[s : s + k] % cp).tolist())
        )
        at = int(units[u[s]])
        for cnt, _, r in rows:
            out[at : at + cnt] = r
            at += cnt
    return out


def oriented_where_no_worse(
    owner: np.ndarray, tables: ChunkTables, skip: np.ndarray | None = None
) -> np.ndarray:
    """A copy of `owner` with the cut units reordered one at a time (`oriented` on that unit alone, any
    number of holders), each kept only where the placement's metric `max fwd + max bwd` and its predicted
    step (kernel and link time, `documents_repair`'s prices) do not rise: the units whose short pieces can
    go first without a slower rank. Units in order of the keys the reordering saves, most first.

    Args:
        owner: int64 `[n]`, the rank of each chunk.
        tables: the chunks' tables, ranks, law and node size (`documents_repair.ChunkTables`).
        skip: bool `[u]`, units left as they are.

    Returns:
        int64 `[n]`: the owners after the kept reorderings (every rank's chunk count kept, per unit too).
    """
    units, cp = tables.units, tables.cp
    st = _State(owner.copy(), tables)
    metric, step = st.metric()
    tried = []
    for u in range(units.size - 1):
        a, b = int(units[u]), int(units[u + 1])
        if (skip is not None and skip[u]) or b - a < 2:
            continue
        old = st.owner[a:b]
        if old.min() == old.max():
            continue
        new = oriented(old, np.asarray([0, b - a], dtype=np.int64), cp, cp)
        if np.array_equal(new, old):
            continue
        # keys its holders need before the reordering less after (a causal unit: each run's start)
        saved = _run_starts(old) - _run_starts(new)
        if saved > 0:
            tried.append((-saved, u, new))
    for _, u, new in sorted(tried, key=lambda x: (x[0], x[1])):
        a = int(units[u])
        holders = sorted(set(new.tolist()), key=lambda r: (int((new == r).sum()), r))
        parts = [(a + np.flatnonzero(new == r), r) for r in holders]
        for s in holders:  # `trial` prices the others only where rank s gains
            m, p, times = st.trial(s, parts)
            if m < float("inf"):
                break
        if m <= metric and p <= step:
            st.apply(parts, times)
            metric, step = st.metric()
    return st.owner


def _run_starts(seg: np.ndarray) -> int:
    """Sum over the ranks holding chunks of one unit (`seg`: their owners in order) of the chunks before
    each rank's last chunk that it does not hold: a causal unit's received keys in chunks."""
    out = 0
    for r in set(seg.tolist()):
        idx = np.flatnonzero(seg == r)
        out += int(idx[-1]) + 1 - idx.size
    return out
