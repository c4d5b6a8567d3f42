"""The documents placement's balance polish: block swaps chosen by a smoothed slowest rank.

The local repair (`documents_repair`) lowers `max fwd + max bwd` one swap at a time and stops where no
single swap lowers it: on a plateau where two ranks are slowest in one direction, or where the slowest
forward and the slowest backward are different ranks (a rank heavy in tiles and one heavy in received keys:
moving work off one makes the other slower). The polish searches a wider set of swaps with a smooth
objective, the log-sum-exp of the ranks' forward times plus that of their backward times at a temperature
of `_TAU` of the mean rank's forward + backward: it falls whenever a near-slowest rank gets faster in either
direction, so a sequence of swaps can lower the second slowest before the slowest, and the ranks' tiles and
received keys even out together (both directions balance only where both do).

A move swaps a block of k chunks at an end of one of rank s's runs (k in `_SIZES`, or the whole run) with a
block of as many chunks at an end of one of a partner's runs, so every rank keeps its chunk count; s is
among the `_CRITICAL` slowest ranks of each direction, the partners the `_PARTNERS` least loaded ranks of
each. Every such swap is screened at once (numpy): its two ranks' new times by the law from the blocks'
areas (exact) and key columns (a block's removal exact, its insertion against the other rank's key union
before the swap); the `_SCREENED` best are priced exactly (the union of the keys their rows need) and the
best that lowers the objective is made. The pieces stay pieces: no swap leaves a rank with more than `runs`
runs of a unit (or more than it had), and all swaps together add at most `_MORE_CUTS` (unit, rank) pairs
per rank. With `links` > 0 the objective also counts the slowest rank's received keys at the slower link's
rate, so the balance is not bought with link time. At most `steps` swaps and `trials` exact prices; a pure,
deterministic function of the assignment (every rank polishes alike).
"""

from __future__ import annotations

import numpy as np

from .documents_repair import ChunkTables, _State
from .pricing import INTERNODE_GBPS, INTRANODE_GBPS, KV_BYTES_PER_TOKEN

__all__ = ["BALANCED", "polish", "polish_variants"]

_TAU = 0.005
"""The objective's temperature, as a share of the mean rank's forward + backward time: small enough that the
objective is the slowest ranks', large enough that the next slowest count (a 1 % gap weighs e^-2)."""
_SIZES = (1, 2, 4, 8, 16)
"""Block sizes (chunks) tried at each end of a run, besides the whole run."""
_CRITICAL = 2
"""The slowest ranks of each direction a swap is looked for from."""
_SCREENED = 4
"""Screened swaps priced exactly per rank looked from."""
_TRIALS = 1200
"""Swaps priced exactly at most in all (each reprices the key unions of its two ranks)."""
_PARTNERS = 6
"""Ranks of least forward time and of least backward time a rank swaps with."""
_RUNS = 2
"""Runs of one unit a rank may hold by default (an early and a late piece, as the fills lay them; a unit
alone stays cut like zigzag)."""
_MORE_CUTS = 2.0
"""(unit, rank) pairs holding chunks the polish may add, per rank: units stay whole where they were, and a
cut unit spreads over a few more ranks at most."""
BALANCED = 0.01
"""The polish stops once `max fwd + max bwd` is within this share of `mean fwd + mean bwd` (the caller does
not start it there): a step's worth of planning per new mask is not spent on less."""
_STEPS = 48
"""Swaps made at most (the polish stops earlier where none lowers the objective)."""


def _union(lo: np.ndarray, hi: np.ndarray, ordered: bool) -> tuple[np.ndarray, np.ndarray]:
    """The union of intervals `[lo, hi)` as sorted disjoint `(starts, ends)` (touching ones merged)."""
    if lo.size == 0:
        return lo, hi
    if not ordered:
        order = np.argsort(lo, kind="stable")
        lo, hi = lo[order], hi[order]
    reach = np.maximum.accumulate(hi)
    new = np.ones(lo.size, dtype=bool)
    new[1:] = lo[1:] > reach[:-1]
    at = new.nonzero()[0]
    return lo[at], np.maximum.reduceat(hi, at)


def _overlap(a: np.ndarray, b: np.ndarray, starts: np.ndarray, ends: np.ndarray) -> np.ndarray:
    """Tokens of each interval `[a[i], b[i])` covered by the disjoint intervals `[starts, ends)`."""
    if starts.size == 0 or a.size == 0:
        return np.zeros(a.size, dtype=np.int64)
    inner = np.minimum(b[:, None], ends[None, :]) - np.maximum(a[:, None], starts[None, :])
    return np.maximum(inner, 0).sum(axis=1)


class _Blocks:
    """One rank's swappable blocks: chunk ranges `[first, first + size)` at the ends of its runs, with their
    mask area, the key tokens the rank loses with them (`rem`, <= 0) and the union of the keys their own
    rows need (`seg_of`, `seg_lo`, `seg_hi`: each block's disjoint key intervals); and the rank's key union."""

    def __init__(self, r: int, owner: np.ndarray, lo: np.ndarray, hi: np.ndarray, area_cum: np.ndarray,
                 ordered: bool) -> None:  # fmt: skip
        idx = (owner == r).nonzero()[0]
        self.starts, self.ends = _union(lo[idx], hi[idx], ordered)
        first, size = [], []
        if idx.size:
            brk = (np.diff(idx) != 1).nonzero()[0]
            heads = idx[np.concatenate([[0], brk + 1])].tolist()
            tails = idx[np.concatenate([brk, [idx.size - 1]])].tolist()
            seen = set()
            for a, b in zip(heads, tails):
                n = b - a + 1
                for k in sorted({k for k in _SIZES if k < n} | {n}):
                    for x in (a, b - k + 1):
                        if (x, k) not in seen:
                            seen.add((x, k))
                            first.append(x)
                            size.append(k)
        self.first = np.asarray(first, dtype=np.int64)
        self.size = np.asarray(size, dtype=np.int64)
        self.area = area_cum[self.first + self.size] - area_cum[self.first]
        # every block at once on the rank's key segments (between consecutive interval ends): a segment
        # leaves the rank's union with a block when the block's chunks are all that cover it
        l, h = lo[idx], hi[idx]
        pts = np.unique(np.concatenate([l, h, [0]]))  # never empty (a rank without chunks has no blocks)
        cover = (l[:, None] <= pts[None, :-1]) & (h[:, None] >= pts[None, 1:])  # chunk x segment
        below = np.zeros((idx.size + 1, pts.size - 1), dtype=np.int64)
        np.cumsum(cover, axis=0, out=below[1:])
        pos = np.searchsorted(idx, self.first)
        mine = below[pos + self.size] - below[pos]  # block x segment: the block's chunks covering it
        width = np.diff(pts)
        self.rem = -(((mine == below[-1]) & (mine > 0)) * width).sum(axis=1)
        # each block's own key intervals: its covered segments, touching ones merged
        held = np.zeros((self.first.size, pts.size + 1), dtype=bool)
        held[:, 1:-1] = mine > 0
        step = np.diff(held.astype(np.int8), axis=1)
        self.seg_of, at = (step == 1).nonzero()  # row-major: each block's starts in order, as its ends
        self.seg_lo = pts[at]
        self.seg_hi = pts[(step == -1).nonzero()[1]]


def _lse(x: np.ndarray, tau: float) -> float:
    m = float(x.max())
    return m + tau * float(np.log(np.exp((x - m) / tau).sum()))


def _objective(fwd: np.ndarray, bwd: np.ndarray, link: np.ndarray, links: float, tau: float) -> float:
    """The smoothed kernel metric `max fwd + max bwd`, plus `links` times the smoothed slowest link time."""
    out = _lse(fwd, tau) + _lse(bwd, tau)
    return out + links * _lse(link, tau) if links else out


def polish(
    owner: np.ndarray,
    chunks: ChunkTables,
    steps: int = _STEPS,
    trials: int = _TRIALS,
    links: float = 0.0,
    runs: int = _RUNS,
) -> np.ndarray:
    """A copy of `owner` (int64 `[n]`, the rank of each chunk) after the balance polish (module docstring).

    Args:
        owner: an assignment (every rank's chunk count is kept).
        chunks: the chunks' tables, the rank count and the law (`documents_repair.ChunkTables`).
        steps: swaps made at most.
        trials: swaps priced exactly at most (the polish's time is about proportional).
        links: weight of the slowest rank's link time in the objective, its received keys priced at the
            slower link's rate (between nodes past one node): 0 balances the kernels alone; 2 bounds the
            step's link share too (`step <= max fwd + max bwd + 2 max link`).
        runs: runs of one unit a rank may hold after a swap (unless it held more before).

    Returns:
        int64 `[n]`: the polished owners. The smoothed objective never rises; the caller judges the result
        by its exact price (the links included) before keeping it.
    """
    return polish_variants(owner, chunks, [(links, runs)], steps, trials)[0]


def polish_variants(
    owner: np.ndarray, chunks: ChunkTables, variants: list[tuple[float, int]], steps: int = _STEPS,
    trials: int = _TRIALS,
) -> list[np.ndarray]:  # fmt: skip
    """`polish(owner, chunks, steps, trials, links, runs)` for each `(links, runs)` of `variants`, the ranks'
    blocks (`_Blocks`, most of the set-up) built once for all."""
    if chunks.cp <= 2:
        return [owner.copy() for _ in variants]
    lo, hi = chunks.lo, chunks.hi
    ordered = bool((np.diff(lo) >= 0).all())
    area_cum = np.concatenate([[0.0], np.cumsum(chunks.area, dtype=np.float64)])
    blocks = [_Blocks(r, owner, lo, hi, area_cum, ordered) for r in range(chunks.cp)]
    return [
        _polish(owner, chunks, steps, trials, links, runs, list(blocks), area_cum, ordered)
        for links, runs in variants
    ]


def _polish(
    owner: np.ndarray, chunks: ChunkTables, steps: int, trials: int, links: float, runs: int,
    blocks: list[_Blocks], area_cum: np.ndarray, ordered: bool,
) -> np.ndarray:  # fmt: skip
    """`polish` from the ranks' blocks of `owner` (replaced in `blocks` as swaps are made)."""
    cp = chunks.cp
    st = _State(owner.copy(), chunks)
    lo, hi = chunks.lo, chunks.hi
    own = np.bincount(st.owner, minlength=cp).astype(np.float64) * chunks.tokens_per_chunk
    rank_area = np.bincount(st.owner, weights=chunks.area, minlength=cp)
    keys = np.asarray([float((b.ends - b.starts).sum()) for b in blocks])
    tau = _TAU * float(st.fwd.mean() + st.bwd.mean())
    if tau <= 0:
        return st.owner
    gbps = INTERNODE_GBPS if cp > chunks.node else INTRANODE_GBPS
    rate = KV_BYTES_PER_TOKEN / (gbps * 1e9) * 1e3  # ms per received key
    link = np.maximum(keys - own, 0.0) * rate
    goal = _objective(st.fwd, st.bwd, link, links, tau)
    priced = 0
    # the (unit, rank) pairs holding chunks: at most `_MORE_CUTS` per rank more than the input's
    held, _ = _holdings(st, list(range(chunks.units.size - 1)), ())
    cap = held + int(_MORE_CUTS * cp)
    for _ in range(steps):
        if st.fwd.max() + st.bwd.max() <= (st.fwd.mean() + st.bwd.mean()) * (1.0 + BALANCED):
            break  # balanced: what is left to gain is below the law's error
        looked = list(dict.fromkeys(
            [int(x) for x in np.argsort(-st.fwd, kind="stable")[:_CRITICAL]]
            + [int(x) for x in np.argsort(-st.bwd, kind="stable")[:_CRITICAL]]
        ))  # fmt: skip
        best = None
        for s in looked:  # each looked-from rank's best screened swaps, priced exactly
            for _, _, _, parts in _screened_swaps(
                s, st, blocks, keys, rank_area, own, tau, goal, link, links, rate
            ):
                priced += 1
                times = _kernel_times(st, s, parts)
                if not times:  # s slower both ways
                    continue
                f, b, m = st.fwd.copy(), st.bwd.copy(), link.copy()
                for r, (x, y, k) in times.items():
                    f[r], b[r], m[r] = x, y, max(k - own[r], 0.0) * rate
                got = _objective(f, b, m, links, tau)
                if got < goal * (1.0 - 1e-9) and (best is None or got < best[0]):
                    # the pieces' limits, checked only for a swap that would be made
                    more = _cuts_added(st, s, parts, runs)
                    if more is not None and held + more <= cap:
                        best = (got, s, parts[0][1], parts, times, more)
        if best is None:
            break
        goal, s, t, parts, times, more = best
        held += more
        st._move(parts, False)
        for r, (x, y, k) in times.items():
            st.fwd[r], st.bwd[r], link[r] = x, y, max(k - own[r], 0.0) * rate
        (u, _), (v, _) = parts
        delta = float(chunks.area[u].sum() - chunks.area[v].sum())
        rank_area[s] -= delta
        rank_area[t] += delta
        for r in (s, t):
            blocks[r] = _Blocks(r, st.owner, lo, hi, area_cum, ordered)
            keys[r] = float((blocks[r].ends - blocks[r].starts).sum())
        if priced >= trials:
            break
    return st.owner


def _holdings(st: _State, units: list[int], ranks: tuple[int, int]) -> tuple[int, dict]:
    """Over `units`: how many (unit, rank) pairs hold chunks, and the runs of each unit on each of `ranks`
    (the unit's chunks and the chunk on each side: one a unit shares with its neighbour)."""
    held, runs = 0, {}
    n = st.owner.size
    for w in units:
        held += np.unique(st.owner[st.units[w] : st.units[w + 1]]).size
        o = st.owner[max(int(st.units[w]) - 1, 0) : min(int(st.units[w + 1]) + 1, n)]
        for r in ranks:
            mine = o == r
            runs[w, r] = int(mine[0]) + int((mine[1:] & ~mine[:-1]).sum())
    return held, runs


def _kernel_times(st: _State, s: int, parts: list) -> dict[int, tuple[float, float, int]]:
    """The forward and backward kernel ms and key tokens of rank s and its partner with `parts` swapped
    (the owners are left unchanged); empty where s would be slower both ways (its kernel times)."""
    (_, t), _ = parts
    st._move(parts, False)
    try:
        out = {s: st.kernel(s)}
        if out[s][0] < st.fwd[s] or out[s][1] < st.bwd[s]:
            out[t] = st.kernel(t)
        else:
            out = {}
    finally:
        st._move([(ch, r) for (ch, _), r in zip(parts, (s, t))], False)
    return out


def _cuts_added(st: _State, s: int, parts: list, runs: int) -> int | None:
    """The (unit, rank) pairs holding chunks that swapping `parts` adds, or None where rank s or its
    partner would hold more than `runs` runs of a unit (more than it did, if that was more)."""
    (_, t), _ = parts
    units = sorted({int(w) for ch, _ in parts for w in np.unique(st.unit_of[ch]).tolist()})
    held, was = _holdings(st, units, (s, t))
    st._move(parts, False)
    try:
        now, got = _holdings(st, units, (s, t))
    finally:
        st._move([(ch, r) for (ch, _), r in zip(parts, (s, t))], False)
    return now - held if all(k <= max(runs, was[key]) for key, k in got.items()) else None


def _screened_swaps(
    s: int,
    st: _State,
    blocks: list[_Blocks],
    keys: np.ndarray,
    rank_area: np.ndarray,
    own: np.ndarray,
    tau: float,
    goal: float,
    link: np.ndarray,
    links: float,
    rate: float,
) -> list[tuple]:
    """The `_SCREENED` best swaps from rank s by the screened objective, those not far above `goal`:
    `(screened objective, s, index, parts)` with parts `[(chunks of s, t), (chunks of t, s)]`."""
    cp = st.cp
    mine = blocks[s]
    if mine.first.size == 0:
        return []
    # partners: the ranks of least forward and least backward time (a swap from a slowest rank lowers the
    # objective most with a rank that has room in the direction it gives to)
    law = st.law
    room = [int(x) for d in (st.fwd, st.bwd) for x in np.argsort(d, kind="stable")[: _PARTNERS + 1]]
    others = sorted({t for t in room if t != s and blocks[t].first.size})
    if not others:
        return []
    # the partners' blocks in one table
    t_of = np.concatenate([np.full(blocks[t].first.size, t, dtype=np.int64) for t in others])
    t_j = np.concatenate([np.arange(blocks[t].first.size) for t in others])
    t_size = np.concatenate([blocks[t].size for t in others])
    t_area = np.concatenate([blocks[t].area for t in others])
    t_rem = np.concatenate([blocks[t].rem for t in others])
    # keys each partner block adds to s; keys each of s's blocks adds to each partner (one array op each)
    base = np.cumsum([0] + [blocks[t].first.size for t in others])
    seg_of = np.concatenate([blocks[t].seg_of + b for t, b in zip(others, base[:-1].tolist())])
    seg_lo = np.concatenate([blocks[t].seg_lo for t in others])
    seg_hi = np.concatenate([blocks[t].seg_hi for t in others])
    new = (seg_hi - seg_lo) - _overlap(seg_lo, seg_hi, mine.starts, mine.ends)
    into_s = np.bincount(seg_of, weights=new, minlength=int(base[-1]))
    u_lo = np.concatenate([blocks[t].starts for t in others])
    u_hi = np.concatenate([blocks[t].ends for t in others])
    u_at = np.cumsum([0] + [blocks[t].starts.size for t in others[:-1]])  # each partner's first interval
    inner = np.minimum(mine.seg_hi[:, None], u_hi[None, :]) - np.maximum(mine.seg_lo[:, None], u_lo[None, :])
    covered = np.add.reduceat(np.maximum(inner, 0), u_at, axis=1)  # segment x partner: keys it holds
    new = (mine.seg_hi - mine.seg_lo)[:, None] - covered
    # a block's segments are consecutive (`_Blocks`) and every block has one at least (its own keys)
    into_t = np.zeros((cp, mine.first.size))
    into_t[others] = np.add.reduceat(new, np.searchsorted(mine.seg_of, np.arange(mine.first.size)), axis=0).T
    ui, vi = [], []
    for k in np.unique(mine.size).tolist():
        a = (mine.size == k).nonzero()[0]
        b = (t_size == k).nonzero()[0]
        if a.size and b.size:
            ui.append(np.repeat(a, b.size))
            vi.append(np.tile(b, a.size))
    if not ui:
        return []
    u = np.concatenate(ui)
    v = np.concatenate(vi)
    t = t_of[v]
    area_s = rank_area[s] - mine.area[u] + t_area[v]
    area_t = rank_area[t] - t_area[v] + mine.area[u]
    keys_s = keys[s] + mine.rem[u] + into_s[v]
    keys_t = keys[t] + t_rem[v] + into_t[t, u]
    f_s, b_s = law.fwd_ms(area_s, keys_s, own[s]), law.bwd_ms(area_s, keys_s, own[s])
    f_t, b_t = law.fwd_ms(area_t, keys_t, own[t]), law.bwd_ms(area_t, keys_t, own[t])

    def lse_pair(x: np.ndarray, x_s: np.ndarray, x_t: np.ndarray) -> np.ndarray:
        """The log-sum-exp of `x` with entries s and t replaced by each pair's (shifted by x's maximum)."""
        m = float(x.max())
        e = np.exp((x - m) / tau)
        rest = np.maximum(e.sum() - e[s] - e[t], 0.0)
        inner = rest + np.exp(np.minimum((x_s - m) / tau, 700)) + np.exp(np.minimum((x_t - m) / tau, 700))
        return m + tau * np.log(np.maximum(inner, 1e-300))

    screened = lse_pair(st.fwd, f_s, f_t) + lse_pair(st.bwd, b_s, b_t)
    if links:
        c_s = np.maximum(keys_s - own[s], 0.0) * rate
        c_t = np.maximum(keys_t - own[t], 0.0) * rate
        screened = screened + links * lse_pair(link, c_s, c_t)
    if screened.size > _SCREENED:
        top = np.argpartition(screened, _SCREENED)[:_SCREENED]
        order = top[np.lexsort((top, screened[top]))]
    else:
        order = np.lexsort((np.arange(screened.size), screened))
    out = []
    for i in order.tolist():
        if screened[i] >= goal + abs(goal) * 1e-3:  # screened far worse: not worth pricing
            break
        tt = int(t[i])
        cu = np.arange(mine.first[u[i]], mine.first[u[i]] + mine.size[u[i]], dtype=np.int64)
        tb = blocks[tt]
        j = int(t_j[v[i]])
        cv = np.arange(tb.first[j], tb.first[j] + tb.size[j], dtype=np.int64)
        out.append((float(screened[i]), s, i, [(cu, tt), (cv, s)]))
    return out
