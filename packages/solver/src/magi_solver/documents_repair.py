"""The documents placement's local repair: chunk swaps between the slowest rank and its neighbours.

The fills (`documents`) balance one summed price per rank (forward + backward) against a common target, so
a rank holding a long unit's tail, whose rows need all its earlier keys, can end above the others. The
metric the placement answers to is `max_r fwd_r + max_r bwd_r` of predicted kernel time, each direction by
its own law. The repair lowers it directly: while the rank that sets the slowest forward or the slowest
backward can

* shift a cut point by one chunk towards a neighbouring rank (its chunk at the end of a run, next in the
  sequence to a chunk of that rank) and take back one chunk from a cut point it shares with that rank
  the other way (or a one-chunk unit of that rank's),
* give a whole unit to a rank and take back a whole unit of the same chunk count (units stay whole), or
  the same count of chunks from a cut point the two share (the cut shifts by that many chunks),

and the metric falls while the predicted step (kernel plus link time, `pricing`'s price) does not rise,
the best such swap is made. Every rank keeps its chunk count. Each step prices the two ranks it changes
exactly (their area, rows, and the union of the keys their rows need); past one node, only ranks of one
node swap (no other rank's link time changes). At most `_STEPS` swaps: about linear in the chunks.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .kernel_law import TILE, KernelLaw
from .pricing import INTERNODE_GBPS, INTRANODE_GBPS, KV_BYTES_PER_TOKEN

__all__ = ["repair"]

_STEPS_PER_RANK = 2
"""Swaps made at most per rank (the pass stops earlier once no swap lowers the metric)."""
_PARTNERS = 2
_NEIGHBOURS = 4
"""Neighbours in the sequence (the least loaded first) a rank swaps with in one step, at most."""
"""Least loaded ranks (besides the neighbours in the sequence) offered a whole-unit swap."""
_UNITS = 4
"""Whole units of a rank tried in one step (the costliest per chunk first)."""
_ENDS = 8
"""Run ends of a partner offered back for one chunk, at most."""
_MAX_STEPS = 48
"""Swaps made at most in all (with `_STEPS_PER_RANK`: a bound on the pass's time at large cp)."""
_EVALS = 3000
"""Ranks priced at most in one pass (each swap tried prices one or two): the pass's time stays within a
few tens of milliseconds whatever the mask; a deterministic count, so every rank repairs alike."""
_CUT_GAIN = 0.01
"""A swap that adds a cut inside a unit (a run of a unit on one rank more) must lower the metric by this
share: cut points move freely, new ones only for a clear gain (a unit alone stays cut like zigzag)."""
_STEP_SLACK = 1e-12
_BALANCED = 0.005
"""An assignment whose `max fwd + max bwd` is within this share of `mean fwd + mean bwd` is not repaired."""
_HELD_BY_HAND = 8
"""Up to this many key intervals, a rank's tokens held by its node are summed in Python (`_State._inside`)."""
_GAIN = 1e-6
"""A swap must lower the metric by this share at least (no churn on rounding)."""


@dataclass(frozen=True)
class ChunkTables:
    """What the repair prices an assignment with: per chunk its mask area (float64 `[n]`) and the interval of
    keys its rows need, own tokens included (`lo`, `hi`: int64 `[n]`); the units' chunk boundaries (int64,
    0 ... n); tokens per chunk; ranks; the kernel law; ranks per node (past it, link time from other nodes
    is priced)."""

    area: np.ndarray
    lo: np.ndarray
    hi: np.ndarray
    units: np.ndarray
    tokens_per_chunk: int
    cp: int
    law: KernelLaw
    node: int


class _State:
    """Per-rank predicted kernel and link times of an assignment, with the tables to reprice one rank."""

    def __init__(self, owner: np.ndarray, chunks: ChunkTables) -> None:
        self.owner = owner
        self.area, self.lo, self.hi, self.c = chunks.area, chunks.lo, chunks.hi, chunks.tokens_per_chunk
        self.cp, self.law, self.units = chunks.cp, chunks.law, chunks.units
        self.node = chunks.node if chunks.cp > chunks.node else chunks.cp
        cp = chunks.cp
        self.unit_of = np.searchsorted(chunks.units, np.arange(owner.size), side="right") - 1
        # packed documents, clips and windows: each chunk's first key is at or after the previous chunk's
        self._lo_sorted = bool((np.diff(self.lo) >= 0).all())
        self.evals = 0  # ranks priced so far (the pass's budget, `_EVALS`)
        self.fwd = np.zeros(cp)
        self.bwd = np.zeros(cp)
        self.comm = np.zeros(cp)
        self._known: dict[int, tuple] = {}  # rank -> `_intervals` on its current chunks (`link_only`)
        self._unit_ranks: dict[int, set[int]] = {}  # unit -> the ranks holding it (`_holders`)
        self._node_prefix()
        for r in range(cp):
            self.fwd[r], self.bwd[r], self.comm[r] = self.rank(r)

    def _node_prefix(self) -> None:
        """Chunks of each node below each chunk index (`[nodes, n + 1]`): the keys a rank's node holds."""
        nodes = -(-self.cp // self.node)
        of = self.owner // self.node
        self.npre = np.zeros((nodes, self.owner.size + 1), dtype=np.int64)
        for k in range(nodes):
            self.npre[k, 1:] = np.cumsum(of == k)

    def _held(self, k: int, x: int) -> int:
        """Tokens below token x held by node k."""
        j, rem = divmod(x, self.c)
        out = int(self.npre[k, j]) * self.c
        if rem and j < self.owner.size and self.owner[j] // self.node == k:
            out += rem
        return out

    def _intervals(self, r: int) -> tuple[list[int], list[int], int, int, float]:
        """Rank r's key intervals on the current owners (the union of its chunks' needs, own tokens included):
        `(starts, ends, key tokens, own tokens, area)`; empty lists where it holds no chunk."""
        # `.nonzero()[0]` of 1-D masks here and below: `np.flatnonzero`'s ravel costs as much on these small arrays
        idx = (self.owner == r).nonzero()[0]
        if idx.size == 0:
            return [], [], 0, 0, 0.0
        lo, hi = self.lo[idx], self.hi[idx]
        if not self._lo_sorted:  # else any rank's chunks, in sequence order, are sorted by lo already
            order = np.argsort(lo, kind="stable")
            lo, hi = lo[order], hi[order]
        reach = np.maximum.accumulate(hi)
        new = np.ones(lo.size, dtype=bool)
        new[1:] = lo[1:] > reach[:-1]
        starts = lo[new]
        ends = np.maximum.reduceat(hi, new.nonzero()[0])
        keys = int((ends - starts).sum())
        return starts.tolist(), ends.tolist(), keys, idx.size * self.c, float(self.area[idx].sum())

    def _link_ms(self, r: int, starts: list[int], ends: list[int], keys: int, own: int) -> float:
        """Rank r's link time (ms) for its key intervals on the current owners and node tables."""
        remote = keys - own
        inter = 0
        if self.cp > self.node:
            inter = keys - self._inside(r // self.node, starts, ends)
        nv = (remote - inter) * KV_BYTES_PER_TOKEN / (INTRANODE_GBPS * 1e9)
        ib = inter * KV_BYTES_PER_TOKEN / (INTERNODE_GBPS * 1e9)
        return max(nv, ib) * 1e3

    def _inside(self, k: int, starts: list[int], ends: list[int]) -> int:
        """Tokens of the intervals `[starts[i], ends[i])` held by node k (`_held` at both ends; past
        `_HELD_BY_HAND` intervals in numpy, the same integers)."""
        if len(starts) <= _HELD_BY_HAND:
            return sum(self._held(k, b) - self._held(k, a) for a, b in zip(starts, ends))
        x = np.asarray(starts + ends, dtype=np.int64)
        j, rem = np.divmod(x, self.c)
        n = self.owner.size
        held = self.npre[k, j] * self.c
        mine = (rem > 0) & (j < n) & (self.owner[np.minimum(j, n - 1)] // self.node == k)
        held += np.where(mine, rem, 0)
        m = len(starts)
        return int(held[m:].sum() - held[:m].sum())

    def rank(self, r: int) -> tuple[float, float, float]:
        """Rank r's forward and backward kernel ms and link ms on the current owners."""
        self.evals += 1
        starts, ends, keys, own, a = self._intervals(r)
        if not starts:
            return 0.0, 0.0, 0.0
        comm = self._link_ms(r, starts, ends, keys, own)
        return (*self.kernel_ms(a, keys, own), comm)

    def kernel(self, r: int) -> tuple[float, float, int]:
        """Rank r's forward and backward kernel ms and key tokens (own included) on the current owners (not
        counted in `evals`: the polish and the annealing check price with it)."""
        _, _, keys, own, a = self._intervals(r)
        return (*self.kernel_ms(a, keys, own), keys)

    def kernel_ms(self, a: float, keys: int, own: int) -> tuple[float, float]:
        """`law.fwd_ms` / `bwd_ms` of one rank (area, key tokens, own tokens), in scalars: this runs for
        every swap tried. No tiles: no kernel call (`kernel_law.DirectionLaw.us`)."""
        if a <= 0:
            return 0.0, 0.0
        t, k, q = a / (TILE * TILE), keys / TILE, -(-own // TILE)
        f, b = self.law.fwd, self.law.bwd
        ms = self.law.scale * 1e-3
        fwd = (f.tiles * t + f.key_columns * k + f.rows * q + f.call) * ms
        bwd = (b.tiles * t + b.key_columns * k + b.rows * q + b.call) * ms
        return fwd, bwd

    def link_only(self, r: int) -> tuple[float, float, float]:
        """`rank(r)` for a rank whose chunks are those it held when last priced (another rank's chunks
        changed node): its kernel times kept, its link time from its remembered key intervals (the same
        arithmetic as `rank`, so the same floats); counted as one rank priced."""
        self.evals += 1
        iv = self._known.get(r)
        if iv is None:
            iv = self._known[r] = self._intervals(r)
        starts, ends, keys, own, _ = iv
        if not starts:
            return 0.0, 0.0, 0.0
        return float(self.fwd[r]), float(self.bwd[r]), self._link_ms(r, starts, ends, keys, own)

    def metric(self) -> tuple[float, float]:
        """(max fwd + max bwd of kernel time, the predicted step with the links)."""
        return (
            float(self.fwd.max() + self.bwd.max()),
            float((self.fwd + self.comm).max() + (self.bwd + self.comm).max()),
        )

    def trial(self, s: int, parts: list[tuple[np.ndarray, int]]) -> tuple[float, float, dict]:
        """The metric with each `(chunks, rank)` of `parts` moved to that rank (rank s among those that
        give); the owners are left unchanged. Returns (metric, step, the changed ranks' new times)."""
        old = [self.owner[ch].copy() for ch, _ in parts]
        ranks = {s} | {r for _, r in parts} | {r for o in old for r in o.tolist()}
        moved = set(ranks)  # the ranks whose chunks change (the others' kernel times cannot)
        cross = self._crossing(parts, old)
        if cross:  # chunks change node: every rank needing their keys may fetch more or less from others
            for ch, _ in parts:
                for u in np.unique(self.unit_of[ch]).tolist():
                    ranks |= self._holders(u)
        at = sorted({y for ch, _ in parts for x in np.atleast_1d(ch).tolist() for y in (x, x + 1)})
        runs = self._runs(at)
        self._move(parts, cross)
        cuts = self._runs(at) - runs  # new cuts inside units: worth it only for a clear gain
        times = {s: self.rank(s)}
        if times[s][0] < self.fwd[s] or times[s][1] < self.bwd[s]:  # else s is slower both ways: no gain
            for r in sorted(ranks - {s}):
                times[r] = self.rank(r) if r in moved else self.link_only(r)
        self._move([(ch, o) for (ch, _), o in zip(parts, old)], cross)
        if len(times) < len(ranks):
            return float("inf"), float("inf"), {}
        f, b, m = self.fwd.copy(), self.bwd.copy(), self.comm.copy()
        for r, (x, y, z) in times.items():
            f[r], b[r], m[r] = x, y, z
        metric = float(f.max() + b.max())
        if cuts > 0:  # priced as if `_CUT_GAIN` slower: a move that cuts a unit must gain more than that
            metric *= 1.0 + _CUT_GAIN
        return metric, float((f + m).max() + (b + m).max()), times

    def _runs(self, at: list[int]) -> int:
        """How many of the positions `at` start a run of one unit on one rank (a cut or a unit's start)."""
        o, u = self.owner, self.unit_of
        n = o.size
        # a few positions (a swap's chunks and their next ones): scalar look-ups beat numpy's array calls
        return sum(1 for i in at if 0 < i < n and (o[i] != o[i - 1] or u[i] != u[i - 1]))

    def _crossing(self, parts: list, old: list) -> bool:
        """Whether any chunk of `parts` changes node (past one node)."""
        if self.cp <= self.node:
            return False
        return any(bool((o // self.node != r // self.node).any()) for (_, r), o in zip(parts, old))

    def _move(self, parts: list, cross: bool) -> None:
        """Set the owners of `parts` (a rank, or one per chunk); with `cross`, the node tables too."""
        for ch, r in parts:
            if cross:
                xs = np.atleast_1d(ch)
                # one rank for all (the common case) without numpy's broadcast; the old owners read at once
                # (the owners change only after the loop)
                tos = np.asarray(r).reshape(xs.shape).tolist() if np.ndim(r) else [int(r)] * xs.size
                for x, fr, to in zip(xs.tolist(), self.owner[xs].tolist(), tos):
                    a, b = fr // self.node, to // self.node
                    if a != b:
                        self.npre[a, x + 1 :] -= 1
                        self.npre[b, x + 1 :] += 1
            self.owner[ch] = r

    def _holders(self, u: int) -> set[int]:
        """The ranks holding chunks of unit u on the current owners (remembered until a swap moves one)."""
        got = self._unit_ranks.get(u)
        if got is None:
            got = self._unit_ranks[u] = set(np.unique(self.owner[self.units[u] : self.units[u + 1]]).tolist())
        return got

    def apply(self, parts: list[tuple[np.ndarray, int]], times: dict) -> None:
        old = [self.owner[ch].copy() for ch, _ in parts]
        for r in {r for _, r in parts} | {r for o in old for r in o.tolist()}:
            self._known.pop(r, None)
        for ch, _ in parts:
            for u in np.unique(self.unit_of[ch]).tolist():
                self._unit_ranks.pop(u, None)
        self._move(parts, self._crossing(parts, old))
        for r, (x, y, z) in times.items():
            self.fwd[r], self.bwd[r], self.comm[r] = x, y, z


def _edges(owner: np.ndarray, s: int, t: int) -> list[int]:
    """Chunks of s at the end of a run of s's, next in the sequence to a chunk of t (a cut point the two
    share): the chunk that moves when that cut shifts by one towards t."""
    idx = (owner == s).nonzero()[0]
    n = owner.size
    left = idx[(idx > 0) & (owner[np.maximum(idx - 1, 0)] == t)]
    right = idx[(idx < n - 1) & (owner[np.minimum(idx + 1, n - 1)] == t)]
    return sorted(set(left.tolist()) | set(right.tolist()))


def _ends(owner: np.ndarray, t: int) -> list[int]:
    """The first and last chunk of each run of rank t's chunks (at most `_ENDS`, in sequence order): a
    chunk t can hand over while its other chunks stay in runs (a causal unit's first chunk needs no keys
    but its own)."""
    idx = (owner == t).nonzero()[0]
    if idx.size == 0:
        return []
    brk = (np.diff(idx) != 1).nonzero()[0]
    firsts = idx[np.concatenate([[0], brk + 1])]
    lasts = idx[np.concatenate([brk, [idx.size - 1]])]
    return sorted(set(firsts.tolist()) | set(lasts.tolist()))[:_ENDS]


def _block(owner: np.ndarray, x: int, t: int, s: int, k: int) -> np.ndarray | None:
    """k chunks of t from chunk x away from its neighbour of rank s (a cut shifted by k), or None where t's
    run there is shorter."""
    n = owner.size
    step = 1 if x > 0 and owner[x - 1] == s else -1
    end = x + step * (k - 1)
    if not 0 <= end < n:
        return None
    blk = np.arange(x, end + step, step, dtype=np.int64)
    return blk if bool((owner[blk] == t).all()) else None


def _whole_units(st: _State, r: int) -> list[np.ndarray]:
    """The chunks of each unit held whole by rank r, the costliest per chunk first (at most `_UNITS`)."""
    idx = (st.owner == r).nonzero()[0]
    if idx.size == 0:
        return []
    us = np.unique(st.unit_of[idx])
    a, b = st.units[us], st.units[us + 1]
    held = np.bincount(st.unit_of[idx], minlength=st.units.size)[us]
    whole = held == (b - a)
    us, a, b = us[whole], a[whole], b[whole]
    dens = (st.area_cum[b] - st.area_cum[a]) / (b - a)
    order = np.argsort(-dens, kind="stable")[:_UNITS]
    return [np.arange(a[i], b[i], dtype=np.int64) for i in order]


def _moves(st: _State, s: int, partners: list[int]):
    """Candidate swaps between rank s and each partner t (see the module docstring), as `(chunks, new
    rank)` parts."""
    owner = st.owner
    mine = _whole_units(st, s)
    for t in partners:
        e_s = _edges(owner, s, t)
        e_t = _edges(owner, t, s)
        theirs = _whole_units(st, t)
        ones = [u for u in theirs if u.size == 1]
        back = sorted(set(e_t) | set(_ends(owner, t)))
        for x in e_s:  # a cut shifted by one towards t, one chunk back from the end of a run of t's
            for y in back:
                if abs(x - y) > 1:  # the same cut shifted back and forth is no move
                    yield [(np.asarray([x]), t), (np.asarray([y]), s)]
            for u in ones:
                yield [(np.asarray([x]), t), (u, s)]
        for u in mine:  # a whole unit for a whole unit of as many chunks, or for a cut shifted by as many
            for v in theirs:
                if v.size == u.size:
                    yield [(u, t), (v, s)]
            for y in e_t:
                blk = _block(owner, y, t, s, u.size)
                if blk is not None:
                    yield [(u, t), (blk, s)]


def _rotations(st: _State, s: int, nb: list[int]):
    """Three-rank moves from rank s: s gives its chunk at a cut it shares with neighbour b to b and takes
    the chunk at a cut it shares with neighbour a (its run slides towards a), and b hands a the chunk at
    a cut the two share or at the end of one of its runs (every chunk count kept)."""
    owner = st.owner
    for a in nb:
        take = [y for y in _edges(owner, a, s)]
        if not take:
            continue
        for b in nb:
            if b == a:
                continue
            give = _edges(owner, s, b)
            if not give:
                continue
            back = sorted(set(_edges(owner, b, a)) | set(_ends(owner, b)))
            for x in give[:2]:
                for y in take[:2]:
                    for z in back:
                        if z != x:
                            yield [(np.asarray([x]), b), (np.asarray([y]), s), (np.asarray([z]), a)]


def _best_trial(st: _State, s: int, trials, best: tuple | None, metric: float, step: float, budget: int):
    """The best of `best` and the `trials` (parts moved off rank `s`) that lower `metric` by `_GAIN` with a
    step within `_STEP_SLACK` of `step`: `(metric, step, parts, times)`, or None; stops at the budget."""
    for parts in trials:
        if st.evals >= budget:
            break
        m, p, times = st.trial(s, parts)
        if m < metric * (1.0 - _GAIN) and p <= step * (1.0 + _STEP_SLACK) and (best is None or m < best[0]):
            best = (m, p, parts, times)
    return best


def repair(owner: np.ndarray, chunks: ChunkTables, evals: int = _EVALS) -> np.ndarray:
    """A copy of `owner` (int64 `[n]`, the rank of each chunk) after the local repair (module docstring).

    Args:
        owner: the fill's assignment (every rank's chunk count is kept).
        chunks: the chunks' tables, the rank count, the law and the node size (`ChunkTables`).
        evals: ranks priced at most (`_EVALS` by default).

    Returns:
        int64 `[n]`: the repaired owners; the metric `max fwd + max bwd` never rises and the predicted
        step never rises.
    """
    cp = chunks.cp
    if cp <= 2:  # `documents_fills._split_two` tried every balanced split and the nearest unit boundaries;
        return owner.copy()  # the swaps found < 0.1 % more there on packed documents, at most of the time
    st = _State(owner.copy(), chunks)
    st.area_cum = np.concatenate([[0.0], np.cumsum(chunks.area, dtype=np.float64)])
    metric, step = st.metric()
    if metric <= float(st.fwd.mean() + st.bwd.mean()) * (1.0 + _BALANCED):  # nothing worth the search
        return st.owner
    n = st.owner.size
    budget = st.evals + evals
    for _ in range(min(_STEPS_PER_RANK * cp, _MAX_STEPS)):
        crit = sorted({int(np.argmax(st.fwd)), int(np.argmax(st.bwd))})
        best = None
        for s in crit:
            same = np.ones(cp, dtype=bool)
            same[s] = False
            idx = (st.owner == s).nonzero()[0]
            near = np.concatenate([st.owner[idx[idx > 0] - 1], st.owner[idx[idx < n - 1] + 1]])
            load = st.fwd + st.bwd
            nb = [int(t) for t in np.unique(near) if t != s and same[t]]
            nb = sorted(nb, key=lambda t: (load[t], t))[:_NEIGHBOURS]
            light = [int(t) for t in np.argsort(load, kind="stable") if same[t] and int(t) not in nb]
            best = _best_trial(st, s, _moves(st, s, nb + light[:_PARTNERS]), best, metric, step, budget)
            if best is None:  # no swap with one rank: a cut shifted on each side, the two others trading
                best = _best_trial(st, s, _rotations(st, s, nb), best, metric, step, budget)
        if best is None:
            break
        _, step, parts, times = best
        st.apply(parts, times)
        metric = st.metric()[0]
        if st.evals >= budget:
            break
    return st.owner


def hull_traffic(owner: np.ndarray, lo: np.ndarray, hi: np.ndarray, c: int, cp: int) -> np.ndarray:
    """int64 `[cp, cp]`: the K/V tokens rank r fetches from rank s (the diagonal 0), with each chunk's key
    need taken as one interval (`lo`, `hi`, its own tokens included): `pricing.rank_traffic` where every
    chunk's keys are one interval (packed documents, clips, windows), in O(cp x (chunks + runs))."""
    n = owner.size
    span = n * c + 1
    s = lo + owner * span
    e = hi + owner * span
    order = np.argsort(s, kind="stable")
    s, e = s[order], e[order]
    reach = np.maximum.accumulate(e)
    new = np.ones(n, dtype=bool)
    new[1:] = s[1:] > reach[:-1]
    starts = s[new]
    ends = np.maximum.reduceat(e, np.flatnonzero(new))
    rank = starts // span
    a, b = starts - rank * span, ends - rank * span  # each rank's union runs in tokens
    held = np.zeros((cp, n + 1), dtype=np.int64)  # chunks of each rank below each chunk index
    held[owner, np.arange(1, n + 1)] = 1
    held = np.cumsum(held, axis=1)
    aj, bj = a // c, b // c
    tok = (held[:, bj] - held[:, aj]) * c  # [cp, runs], whole chunks from a's chunk to b's
    ar = np.arange(cp)[:, None]
    tok -= np.where(owner[np.minimum(aj, n - 1)][None, :] == ar, a % c, 0)
    tok += np.where((bj < n)[None, :] & (owner[np.minimum(bj, n - 1)][None, :] == ar), b % c, 0)
    out = np.zeros((cp, cp), dtype=np.int64)
    np.add.at(out, rank, tok.T)
    np.fill_diagonal(out, 0)
    return out
