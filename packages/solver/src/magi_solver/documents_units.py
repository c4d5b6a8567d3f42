"""The documents placement's units and prices: chunk tables, the law's price of chunk ranges, the units.

A *unit* is a connected group of slices: rows together with the keys they need (a packed document, a video
clip, a document of sliding windows). `find_units` finds them at chunk granularity; `_Costs` prices any
contiguous chunk range on one rank by the kernel law (its area, its rows, and the keys its rows need).
"""

from __future__ import annotations

import itertools

import numpy as np

from .dispatch import _key_intervals, chunk_areas
from .kernel_law import KernelLaw

__all__ = ["find_units", "token_units"]


def _chunk_tables(slices: list, n: int, c: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, tuple]:
    """Per chunk: mask area, and the lowest / highest key its rows need (its own start / end if none)."""
    starts = np.arange(n, dtype=np.int64) * c
    klo, khi = starts.copy(), starts + c
    pieces = _key_intervals(slices, c)
    chunk, _, kl, kr = pieces
    if chunk.size:
        np.minimum.at(klo, chunk, kl)
        np.maximum.at(khi, chunk, kr)
    return chunk_areas(slices, n * c, c), klo, khi, pieces


_PAST_ANY_KEY = 1 << 62
"""Above every key index (the running minimum's pad)."""


class _Costs:
    """Predicted microseconds (forward + backward, by the law) of contiguous chunk ranges."""

    def __init__(self, area: np.ndarray, klo: np.ndarray, khi: np.ndarray, c: int, law: KernelLaw) -> None:
        self.c, self.klo, self.khi, self.law = c, klo, khi, law
        self.cum = np.concatenate([[0.0], np.cumsum(area, dtype=np.float64)])
        f, b = law.fwd, law.bwd
        s = law.scale
        self.per_tile = (f.tiles + b.tiles) * s / (128 * 128)  # per (q, k) pair
        self.per_col = (f.key_columns + b.key_columns) * s / 128  # per key token
        self.per_row = (f.rows + b.rows) * s / 128  # per query token (rows are whole tiles per chunk)

    def tiling_costs(self, bounds: np.ndarray) -> np.ndarray:
        """`range_cost` of every range `[bounds[i], bounds[i + 1])` of a tiling of the chunks (vectorised)."""
        a, b = bounds[:-1], bounds[1:]
        c = self.c
        lo = np.minimum(np.minimum.reduceat(self.klo, a), a * c)
        hi = np.maximum(np.maximum.reduceat(self.khi, a), b * c)
        area = self.cum[b] - self.cum[a]
        return area * self.per_tile + (hi - lo) * self.per_col + (b - a) * c * self.per_row

    def run_costs(self, bounds: np.ndarray) -> np.ndarray:
        """`range_cost` of every range `[bounds[i], bounds[i + 1])` of consecutive ranges (int64 `bounds`,
        increasing, at most the chunk count), vectorised: the same arithmetic, so the same floats."""
        c = self.c
        a, b = bounds[:-1], bounds[1:]
        big = _PAST_ANY_KEY
        lo = np.minimum(np.minimum.reduceat(np.append(self.klo, big), bounds)[:-1], a * c)
        hi = np.maximum(np.maximum.reduceat(np.append(self.khi, 0), bounds)[:-1], b * c)
        return (
            (self.cum[b] - self.cum[a]) * self.per_tile
            + (hi - lo) * self.per_col
            + (b - a) * c * self.per_row
        )

    def range_cost(self, a: int, b: int) -> float:
        """Chunks [a, b) on one rank: its area, its own tokens and the keys its rows need."""
        c = self.c
        keys = max(b * c, int(self.khi[a:b].max())) - min(a * c, int(self.klo[a:b].min()))
        return (self.cum[b] - self.cum[a]) * self.per_tile + keys * self.per_col + (b - a) * c * self.per_row

    def prefix_costs(self, a: int, end: int) -> np.ndarray:
        """Costs of [a, b) for b = a+1 .. end (nondecreasing in b)."""
        c = self.c
        hi = np.maximum.accumulate(self.khi[a:end])
        lo = np.minimum.accumulate(self.klo[a:end])
        b = np.arange(a + 1, end + 1, dtype=np.int64)
        keys = np.maximum(b * c, hi) - np.minimum(a * c, lo)
        area = self.cum[a + 1 : end + 1] - self.cum[a]
        return area * self.per_tile + keys * self.per_col + (b - a) * c * self.per_row


def token_units(slices: list[tuple[int, int, int, int, int]]) -> list[tuple[int, int]]:
    """Sorted disjoint `[start, end)` token intervals of the units: slices whose rows or keys overlap (as
    intervals of the sequence) belong to one unit; tokens of no slice belong to none."""
    spans = sorted((min(qs, ks), max(qe, ke)) for qs, qe, ks, ke, _ in slices if qe > qs and ke > ks)
    out: list[list[int]] = []
    for a, b in spans:
        if out and a < out[-1][1]:
            out[-1][1] = max(out[-1][1], b)
        else:
            out.append([a, b])
    return [(a, b) for a, b in out]


def find_units(slices: list, costs: _Costs, n: int) -> np.ndarray:
    """int64 `[u + 1]`: chunk boundaries of the chunk-level units (0, ..., n).

    Units rarely start on a chunk boundary: the chunk shared by the end of unit A and the start of unit B
    goes to the side where the two ranges cost less together (for causal documents usually A's: B's first
    rows need only the few keys beside them); a unit inside one chunk joins its neighbours."""
    c = costs.c
    units = token_units(slices)
    cuts = {0, n}
    for (sa, ea), (sb, eb) in itertools.pairwise(units):
        lo, hi = -(-ea // c), sb // c  # chunk boundaries in the gap between A and B, if any
        if lo <= hi:
            cuts.add(lo)
            continue
        j = ea // c  # the shared chunk
        a0, b1 = sa // c, min(n, -(-eb // c))
        to_a = costs.range_cost(a0, j + 1) + (costs.range_cost(j + 1, b1) if j + 1 < b1 else 0.0)
        to_b = (costs.range_cost(a0, j) if a0 < j else 0.0) + costs.range_cost(j, b1)
        cuts.add(j + 1 if to_a <= to_b else j)
    return np.asarray(sorted(x for x in cuts if 0 <= x <= n), dtype=np.int64)
