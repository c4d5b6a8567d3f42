"""The best scaling efficiency a mask allows at a cp size, by the kernel law (a go / no-go bound).

E at cp N is the one-GPU time of the whole mask over N times the slowest rank's time. By the law
(`kernel_law`), the one-GPU time of a direction is `a * tiles + b * columns + c * rows` of the whole mask
(every key a column once, every query a row once). Split over N ranks, the tiles and rows only move between
ranks, but a rank holding part of a unit (a packed document, a clip, a run of windows) also reads the keys
its rows need from outside its part: every such key is one more column. The bound assumes the best any
placement could do:

* perfect balance: the slowest rank costs the mean, `sum over ranks / N`;
* the fewest cuts: a unit no longer than a rank's tokens (`total / N`) stays whole; a longer one is cut into
  `ceil(length / (total / N))` contiguous pieces of equal length (the fewest ranks that hold it);
* every piece reads exactly the keys its rows need and does not hold: for a causal unit the piece holding
  its last rows needs all its earlier keys.

So `E_bound = W / (W + b * extra / 128)` per direction, with `W` the whole mask's law time and `extra` the
received keys of those pieces; it is the same for every placement with these cuts. It is an estimate, not a
ceiling: balance may force a unit onto more ranks than its length needs (a long causal document whose tiles
are several ranks' share), and every extra rank holding its late rows reads all its earlier keys.

The *capacity bound* (`EfficiencyBound.fwd_capacity` / `bwd_capacity`) is a ceiling: no placement that
gives every rank `total / N` tokens beats it by the law. For a time `T` per rank, a rank holding a row
that attends `k` keys reads at least `max(k, total / N)` key columns, so it has `T` minus that column cost
(and its rows and call) left for tiles. The rows of a unit that attend `k` keys or more therefore sit on at
least `n(k) = ceil(their tile time / that room)` ranks (and at least `ceil(their count / (total / N))`),
and those ranks read at least `sum over k of n(k)` of the unit's keys in all (each counted once per rank:
a rank reads a key once). Summing over units, `N * T` must cover every rank's tiles, rows and calls plus
those columns; the least such `T` (bisection: the columns only fall as `T` grows) over the mean rank of
the whole mask gives the bound. It ignores that tokens come in chunks and that a rank's units share its
room, so real placements sit below it.

`balance_bound` answers a narrower question about one plan: with each rank's key columns and rows as the
plan has them, how low could `max fwd + max bwd` go were the mask's tiles spread over the ranks freely
(any real number of tiles per rank)? Below the plan's metric it says how much the placement leaves in the
spread of its tiles; near it, that the received keys themselves set the imbalance.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import numpy as np

from .dispatch import DispatchPlan
from .documents import token_units
from .kernel_law import TILE, DirectionLaw, KernelLaw
from .mask import clip_region, region_of, total_area
from .pricing import PlanPrice

__all__ = ["EfficiencyBound", "balance_bound", "efficiency_bound"]

_SEARCH = 60
"""Halvings of each search in `balance_bound` (far below a microsecond at any plan's scale)."""


@dataclass(frozen=True, slots=True)
class EfficiencyBound:
    """The bound of one mask at one cp size.

    Attributes:
        fwd, bwd: the best E of each direction (1.0: no received keys at all).
        whole_fwd_ms, whole_bwd_ms: the law's one-GPU time of the whole mask.
        extra_keys: keys received by all ranks together under the fewest cuts.
        cut_units: units longer than a rank (cut into pieces).
        fwd_capacity, bwd_capacity: the capacity bound of each direction (module docstring): no placement
            with equal tokens per rank reaches a higher E by the law.
    """

    fwd: float
    bwd: float
    whole_fwd_ms: float
    whole_bwd_ms: float
    extra_keys: int
    cut_units: int
    fwd_capacity: float = 1.0
    bwd_capacity: float = 1.0


def _needed_outside(slices: list, a: int, b: int) -> int:
    """Keys outside [a, b) that rows [a, b) need (the union over slices)."""
    spans = []
    for s in slices:
        r = clip_region(region_of(*s), a, b, 0, 1 << 62)
        if r is not None:
            spans.append((r[2], r[3]))  # the tightened region's columns: the keys those rows see
    spans.sort()
    out, end = 0, -1
    for kl, kr in spans:
        kl = max(kl, end)
        if kr <= kl:
            continue
        out += (kr - kl) - max(0, min(kr, b) - max(kl, a))  # the piece holds the keys inside [a, b)
        end = kr
    return out


def efficiency_bound(slices: list, total: int, cp: int, law: KernelLaw) -> EfficiencyBound:
    """The best E of validated self-attention `slices` over `total` tokens at `cp` ranks (module docstring).

    Raises ValueError for `cp` < 1 or `total` < `cp`."""
    if isinstance(cp, bool) or not isinstance(cp, int) or cp < 1:
        raise ValueError(f"`cp` must be an int >= 1, got {cp!r}")
    if total < cp:
        raise ValueError(f"`total` ({total}) must be at least `cp` ({cp})")
    share = total / cp
    area = total_area(slices)
    whole_f = float(law.fwd_ms(area, total, total))
    whole_b = float(law.bwd_ms(area, total, total))
    extra, cut = 0, 0
    for a, b in token_units(slices):
        if b - a <= share:
            continue
        cut += 1
        k = -(-(b - a) // int(share)) if share >= 1 else b - a
        edges = [a + (b - a) * i // k for i in range(k + 1)]
        members = [s for s in slices if s[0] < b and s[1] > a]
        extra += sum(_needed_outside(members, x, y) for x, y in itertools.pairwise(edges))
    col_f = law.fwd.key_columns * law.scale * 1e-3 * extra / TILE
    col_b = law.bwd.key_columns * law.scale * 1e-3 * extra / TILE
    rows = _unit_rows(slices)
    cap_f = _capacity_ms(rows, area, total, cp, law.fwd, law.scale)
    cap_b = _capacity_ms(rows, area, total, cp, law.bwd, law.scale)
    return EfficiencyBound(
        fwd=whole_f / (whole_f + col_f) if whole_f > 0 else 1.0,
        bwd=whole_b / (whole_b + col_b) if whole_b > 0 else 1.0,
        whole_fwd_ms=whole_f,
        whole_bwd_ms=whole_b,
        extra_keys=int(extra),
        cut_units=cut,
        fwd_capacity=min(1.0, whole_f / (cp * cap_f)) if whole_f > 0 else 1.0,
        bwd_capacity=min(1.0, whole_b / (cp * cap_b)) if whole_b > 0 else 1.0,
    )


def _unit_rows(slices: list) -> list[tuple[np.ndarray, int]]:
    """Per unit: its rows' key counts (int64, descending; rows attending nothing left out) and the count of
    keys its slices read. `slices` are disjoint (as `normalize_mask` returns them), so a row's keys are the
    sum over the slices it is in."""
    out = []
    for a, b in token_units(slices):
        keys = np.zeros(b - a, dtype=np.int64)
        spans = []
        for s in slices:
            if s[0] >= b or s[1] <= a:
                continue
            qs, qe, ks, ke, lo, hi = region_of(*s)
            q = np.arange(max(qs, a), min(qe, b))
            keys[q - a] += np.maximum(np.minimum(ke - 1, q + hi) - np.maximum(ks, q + lo) + 1, 0)
            spans.append((ks, ke))
        read, end = 0, -1
        for ks, ke in sorted(spans):  # the union of the key ranges
            read += max(0, ke - max(ks, end))
            end = max(end, ke)
        out.append((-np.sort(-keys[keys > 0]), read))
    return out


def _capacity_ms(rows: list, area: int, total: int, cp: int, law: DirectionLaw, scale: float) -> float:
    """The least per-rank time (ms) of the capacity bound (module docstring) for one direction's law."""
    us = scale
    a, b = law.tiles * us, law.key_columns * us
    least, most = total // cp, -(-total // cp)  # a rank's tokens (uneven shards differ by one)
    fixed = (law.rows * np.ceil(least / TILE) + law.call) * us  # a rank with tiles pays its rows and call
    ks = [k for k, _ in rows if k.size]
    # a rank whose rows attend nothing costs nothing: only the ranks the attending rows fill surely run
    active = min(cp, -(-sum(k.size for k in ks) // most))
    if a <= 0 or not ks:
        return (a * area / TILE**2 + b * total / TILE + active * fixed) / cp * 1e-3
    # the rows attending >= k keys, for every k: their count and tile time (k from 1 to the unit's most)
    levels = []
    for k, read in rows:
        if k.size:
            kappa = np.arange(1, int(k[0]) + 1)
            count = np.searchsorted(-k, -kappa, side="right")
            levels.append((kappa, count, np.cumsum(a * k / TILE**2)[count - 1], read))
    base = a * area / TILE**2 + active * fixed

    def columns(t: float) -> float:
        cols = 0.0
        for kappa, count, work, read in levels:
            room = t - fixed - b * np.maximum(kappa, least) / TILE
            if room.min() <= 0:
                return float("inf")
            n = np.maximum(np.ceil(work / room - 1e-9), np.ceil(count / most - 1e-9))
            cols += max(float(np.maximum(n, 1).sum()), read)  # every key it reads is read somewhere
        return max(cols, total)  # and every rank reads its own tokens

    lo = base / cp
    hi = lo + b * (total + sum(int(k[0]) for k in ks) * cp) / TILE  # every rank reads every unit: room
    while cp * hi < base + b * columns(hi) / TILE:
        hi *= 2
    for _ in range(_SEARCH):
        mid = 0.5 * (lo + hi)
        if cp * mid >= base + b * columns(mid) / TILE:
            hi = mid
        else:
            lo = mid
    return hi * 1e-3


def balance_bound(plan: DispatchPlan, price: PlanPrice, law: KernelLaw) -> float:
    """The least `max fwd + max bwd` (ms) of `plan`'s ranks by `law` when the mask's tiles may be spread
    over the ranks freely while each rank keeps its key columns and rows (`price.key_columns`,
    `plan.shard_seqlens`): a linear program, solved as a convex search over the forward's level with the
    backward's least level found by bisection for each. Dividing by `mean fwd + mean bwd` of `price` (the
    means do not depend on where the tiles go) gives the least `time_imbalance` those key columns allow."""
    scale = law.scale * 1e-3
    af, ab = law.fwd.tiles * scale, law.bwd.tiles * scale
    cols = np.asarray(price.key_columns, dtype=np.float64)
    rows = np.ceil(np.asarray(plan.shard_seqlens, dtype=np.float64) / TILE)
    f0 = (law.fwd.key_columns * cols + law.fwd.rows * rows + law.fwd.call) * scale
    b0 = (law.bwd.key_columns * cols + law.bwd.rows * rows + law.bwd.call) * scale
    tiles = float(sum(plan.rank_areas)) / (TILE * TILE)
    if af <= 0 or ab <= 0 or tiles <= 0:
        return float(price.fwd_ms.max() + price.bwd_ms.max())

    def least_bwd(fwd: float) -> float:
        """The least backward level at which ranks capped at `fwd` forward hold every tile."""
        room_f = (fwd - f0) / af
        lo, hi = float(b0.max()), float(b0.max()) + ab * tiles
        if np.minimum(room_f, (hi - b0) / ab).sum() < tiles:
            return float("inf")
        for _ in range(_SEARCH):
            mid = 0.5 * (lo + hi)
            if np.minimum(room_f, (mid - b0) / ab).sum() >= tiles:
                hi = mid
            else:
                lo = mid
        return hi

    lo, hi = float(f0.max()), float(f0.max()) + af * tiles
    for _ in range(_SEARCH):  # the least forward level at which the tiles fit at all
        mid = 0.5 * (lo + hi)
        if np.isinf(least_bwd(mid)):
            lo = mid
        else:
            hi = mid
    lo, hi = hi, float(f0.max()) + af * tiles
    for _ in range(_SEARCH):  # fwd + least_bwd(fwd) is convex in fwd (an LP's value): ternary search
        a, b = lo + (hi - lo) / 3, hi - (hi - lo) / 3
        if a + least_bwd(a) <= b + least_bwd(b):
            hi = b
        else:
            lo = a
    return lo + least_bwd(lo)
