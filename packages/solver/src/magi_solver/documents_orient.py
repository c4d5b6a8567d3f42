"""The documents placement's orientation pass: a cut unit's short pieces first, where its keys are few.

A rank holding rows of a causal unit needs every key of the unit before its last row. A unit cut between
ranks therefore costs the rank holding the later piece the whole earlier piece in received keys: a cut at
chunk p of the unit costs p chunks of keys. A fill that lets a unit straddle a rank boundary with a small
remainder on one side costs little only when that remainder is the unit's *first* rows; when it is the last
rows, the remainder's rank receives almost the whole unit. `oriented` keeps every rank's chunk count inside
every unit and only reorders the unit's chunks among its ranks: the ranks holding fewer of its chunks get its
earlier rows, as contiguous runs (the order that receives the fewest keys for those counts).

It is offered as one more candidate beside each fill's assignment (`documents._best_fill`): the reordered
rows move tiles between the ranks (the later rows are the costlier ones), so the law's exact price decides.
"""

from __future__ import annotations

import numpy as np

__all__ = ["oriented"]


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
