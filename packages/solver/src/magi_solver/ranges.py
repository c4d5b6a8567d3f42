"""Half-open integer ranges: `AttnRange` and the immutable collection `AttnRanges`.

A range `[start, end)` holds the tokens `start, start + 1, ..., end - 1`. All values are Python ints.
`AttnRanges` keeps the order it was given (order carries meaning: a recv buffer lists its ranges in
buffer order); methods that need sorted or non-overlapping input say so and raise `ValueError` otherwise.
"""

from __future__ import annotations

import bisect
import itertools
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, overload

from magi_mask import as_int_pairs, check_int

__all__ = ["AttnRange", "AttnRanges", "as_int_pairs"]


_check_int = check_int  # one int rule for every package (magi_mask)


def _check_positive(value: Any, name: str) -> int:
    """`value` as an int >= 1: TypeError as `_check_int`, ValueError naming `name` for zero or less."""
    value = check_int(value, name)
    if value <= 0:
        raise ValueError(f"`{name}` must be positive, got {value}")
    return value


@dataclass(frozen=True, slots=True, order=True)
class AttnRange:
    """The half-open token range `[start, end)` with `0 <= start <= end`."""

    start: int
    end: int

    @classmethod
    def _trusted(cls, start: int, end: int) -> AttnRange:
        """Build without validation (planner-internal, for ints it produced itself)."""
        obj = object.__new__(cls)
        object.__setattr__(obj, "start", start)
        object.__setattr__(obj, "end", end)
        return obj

    def __post_init__(self) -> None:
        start = _check_int(self.start, "start")
        end = _check_int(self.end, "end")
        if start < 0 or end < start:
            raise ValueError(f"AttnRange needs 0 <= start <= end, got [{start}, {end})")
        object.__setattr__(self, "start", start)
        object.__setattr__(self, "end", end)

    @property
    def seqlen(self) -> int:
        return self.end - self.start

    def is_empty(self) -> bool:
        return self.end == self.start

    def intersect(self, other: AttnRange) -> AttnRange:
        """The common part; an empty range at `max(starts)` when they do not meet."""
        start = max(self.start, other.start)
        return AttnRange(start, max(start, min(self.end, other.end)))

    def offset(self, delta: int) -> AttnRange:
        return AttnRange(self.start + delta, self.end + delta)

    def to_tuple(self) -> tuple[int, int]:
        return (self.start, self.end)

    def __repr__(self) -> str:
        return f"[{self.start}, {self.end})"


@dataclass(frozen=True, slots=True)
class AttnRanges:
    """An ordered, immutable sequence of `AttnRange`s.

    Build one with `AttnRanges.from_ranges([[0, 4], [8, 12]])` or `AttnRanges.from_cu_seqlens([0, 4, 12])`.
    """

    ranges: tuple[AttnRange, ...] = ()

    def __post_init__(self) -> None:
        if not isinstance(self.ranges, tuple):
            object.__setattr__(self, "ranges", tuple(self.ranges))
        for i, r in enumerate(self.ranges):
            if not isinstance(r, AttnRange):
                raise TypeError(f"`ranges[{i}]` must be an AttnRange, got {type(r).__name__}")

    # -- construction ---------------------------------------------------------------------------------
    @classmethod
    def from_ranges(cls, ranges: Any) -> AttnRanges:
        """From `[[start, end], ...]`, an `[n, 2]` array or an `AttnRanges` (returned as is)."""
        if isinstance(ranges, AttnRanges):
            return ranges
        return cls(tuple(AttnRange(s, e) for s, e in as_int_pairs(ranges, "ranges")))

    @classmethod
    def from_bounds(cls, starts: Sequence[int], ends: Sequence[int]) -> AttnRanges:
        """From parallel sequences of starts and ends (`[starts[i], ends[i])`), checked as `AttnRange` does
        (ints, `0 <= start <= end`), at a fraction of its per-range cost: for the millions of ranges of an
        unstructured mask."""
        if len(starts) != len(ends):
            raise ValueError(f"`starts` and `ends` differ in length: {len(starts)} vs {len(ends)}")
        make = AttnRange._trusted
        out = []
        for i, (a, b) in enumerate(zip(starts, ends)):
            if type(a) is not int or type(b) is not int:  # the fast path's test; others go through the rule
                a, b = _check_int(a, f"starts[{i}]"), _check_int(b, f"ends[{i}]")
            if a < 0 or b < a:
                raise ValueError(f"AttnRange needs 0 <= start <= end, got [{a}, {b}) at index {i}")
            out.append(make(a, b))
        return cls(tuple(out))

    @classmethod
    def from_cu_seqlens(cls, cu_seqlens: Sequence[int]) -> AttnRanges:
        """`[0, 3, 7]` -> `[[0, 3), [3, 7))`. Must start at 0 and be non-decreasing (empty documents drop out)."""
        cu = [_check_int(v, f"cu_seqlens[{i}]") for i, v in enumerate(_tolist(cu_seqlens))]
        if not cu or cu[0] != 0:
            raise ValueError(f"`cu_seqlens` must start with 0, got {cu[:4]}")
        for i in range(1, len(cu)):
            if cu[i] < cu[i - 1]:
                raise ValueError(
                    f"`cu_seqlens` must be non-decreasing, got {cu[i - 1]} then {cu[i]} at index {i}"
                )
        return cls(tuple(AttnRange(a, b) for a, b in itertools.pairwise(cu) if b > a))

    # -- sequence protocol ----------------------------------------------------------------------------
    def __len__(self) -> int:
        return len(self.ranges)

    def __iter__(self) -> Iterator[AttnRange]:
        return iter(self.ranges)

    @overload
    def __getitem__(self, i: int) -> AttnRange: ...
    @overload
    def __getitem__(self, i: slice) -> AttnRanges: ...
    def __getitem__(self, i: int | slice) -> AttnRange | AttnRanges:
        if isinstance(i, slice):
            return AttnRanges(self.ranges[i])
        return self.ranges[i]

    def __repr__(self) -> str:
        return f"AttnRanges({list(self.ranges)!r})"

    # -- queries --------------------------------------------------------------------------------------
    @property
    def total_seqlen(self) -> int:
        """Sum of lengths (overlaps counted twice)."""
        return sum(r.end - r.start for r in self.ranges)

    @property
    def is_empty(self) -> bool:
        return self.total_seqlen == 0

    def is_sorted(self) -> bool:
        return all(a.start <= b.start for a, b in zip(self.ranges, self.ranges[1:]))

    def is_non_overlap(self) -> bool:
        s = sorted(self.ranges)
        return all(a.end <= b.start for a, b in itertools.pairwise(s))

    def to_tuples(self) -> list[tuple[int, int]]:
        return [(r.start, r.end) for r in self.ranges]

    def to_list(self) -> list[list[int]]:
        return [[r.start, r.end] for r in self.ranges]

    def to_cu_seqlens(self) -> list[int]:
        """Inverse of `from_cu_seqlens` for sorted, contiguous ranges starting at 0."""
        cu = [0]
        for r in self.ranges:
            if r.start != cu[-1]:
                raise ValueError(
                    f"to_cu_seqlens needs contiguous ranges from 0, got {r!r} after end {cu[-1]}"
                )
            cu.append(r.end)
        return cu

    def token_ids(self) -> list[int]:
        """Every token of every range, in range order (for tests and small examples)."""
        return [t for r in self.ranges for t in range(r.start, r.end)]

    # -- algebra --------------------------------------------------------------------------------------
    def sort(self) -> AttnRanges:
        return AttnRanges(tuple(sorted(self.ranges)))

    def merge(self) -> AttnRanges:
        """Sorted union: overlapping or touching ranges fuse; empty ranges vanish."""
        return AttnRanges(tuple(AttnRange(s, e) for s, e in merge_pairs(self.to_tuples())))

    def intersect(self, other: AttnRanges) -> AttnRanges:
        """Sorted, merged set intersection of the two token sets."""
        return AttnRanges(
            tuple(
                AttnRange(s, e)
                for s, e in intersect_pairs(self.merge().to_tuples(), other.merge().to_tuples())
            )
        )

    def find_hole_ranges(self, other: AttnRanges) -> AttnRanges:
        """Tokens of `self` not in `other` (set difference), sorted and merged."""
        return AttnRanges(
            tuple(
                AttnRange(s, e)
                for s, e in subtract_pairs(self.merge().to_tuples(), other.merge().to_tuples())
            )
        )

    def chunk(self, chunk_size: int) -> list[AttnRanges]:
        """Cut the concatenation of the ranges (in order) into pieces of `chunk_size` tokens (last shorter)."""
        chunk_size = _check_int(chunk_size, "chunk_size")
        if chunk_size <= 0:
            raise ValueError(f"`chunk_size` must be positive, got {chunk_size}")
        out: list[AttnRanges] = []
        cur: list[AttnRange] = []
        room = chunk_size
        for r in self.ranges:
            s = r.start
            while s < r.end:
                take = min(room, r.end - s)
                cur.append(AttnRange(s, s + take))
                s += take
                room -= take
                if room == 0:
                    out.append(AttnRanges(tuple(cur)))
                    cur, room = [], chunk_size
        if cur:
            out.append(AttnRanges(tuple(cur)))
        return out

    def make_local(self, global_ranges: AttnRanges) -> AttnRanges:
        """Map ranges of `self` (global tokens) into the coordinates of the concatenation of `global_ranges`.

        Every range of `self` must lie inside the token set of `global_ranges`; a range that straddles two
        pieces that are not adjacent in the concatenation comes back split.
        """
        pieces = [(r.start, r.end) for r in global_ranges]
        order = sorted(range(len(pieces)), key=lambda i: pieces[i][0])
        starts = [pieces[i][0] for i in order]
        base, acc = [0] * len(pieces), 0
        for i, (s, e) in enumerate(pieces):
            base[i] = acc
            acc += e - s
        out: list[tuple[int, int]] = []
        for r in self.ranges:
            s = r.start
            while s < r.end:
                j = bisect.bisect_right(starts, s) - 1
                if j < 0 or pieces[order[j]][1] <= s:
                    raise ValueError(f"token {s} of {r!r} is not in {global_ranges!r}")
                ps, pe = pieces[order[j]]
                e = min(r.end, pe)
                ls = base[order[j]] + s - ps
                if out and out[-1][1] == ls:
                    out[-1] = (out[-1][0], ls + e - s)
                else:
                    out.append((ls, ls + e - s))
                s = e
        return AttnRanges(tuple(AttnRange(a, b) for a, b in out))


def _tolist(x: Any) -> list[Any]:
    return x.tolist() if hasattr(x, "tolist") else list(x)


# -- fast helpers on sorted lists of int pairs (used by the planner's inner loops) ----------------------
def merge_pairs(pairs: Iterable[tuple[int, int]]) -> list[tuple[int, int]]:
    """Sorted union of half-open int pairs; touching pairs fuse, empty pairs vanish."""
    out: list[tuple[int, int]] = []
    for s, e in sorted(pairs):
        if e <= s:
            continue
        if out and s <= out[-1][1]:
            if e > out[-1][1]:
                out[-1] = (out[-1][0], e)
        else:
            out.append((s, e))
    return out


def intersect_pairs(a: list[tuple[int, int]], b: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """Intersection of two sorted, merged pair lists (two-pointer sweep)."""
    out: list[tuple[int, int]] = []
    i = j = 0
    while i < len(a) and j < len(b):
        s, e = max(a[i][0], b[j][0]), min(a[i][1], b[j][1])
        if s < e:
            out.append((s, e))
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return out


def subtract_pairs(a: list[tuple[int, int]], b: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """`a` minus `b`, both sorted and merged."""
    out: list[tuple[int, int]] = []
    j = 0
    for s, e in a:
        while j < len(b) and b[j][1] <= s:
            j += 1
        k = j
        cur = s
        while k < len(b) and b[k][0] < e:
            if b[k][0] > cur:
                out.append((cur, b[k][0]))
            cur = max(cur, b[k][1])
            k += 1
        if cur < e:
            out.append((cur, e))
    return out
