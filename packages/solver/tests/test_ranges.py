"""AttnRange / AttnRanges against Python sets."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from magi_solver import AttnRange, AttnRanges

pairs = st.lists(
    st.tuples(st.integers(0, 40), st.integers(0, 40)).map(lambda t: (min(t), max(t))), max_size=6
)


def _set(r: AttnRanges) -> set[int]:
    return {t for x in r for t in range(x.start, x.end)}


@settings(max_examples=200, deadline=None)
@given(pairs, pairs)
def test_set_algebra(a: list[tuple[int, int]], b: list[tuple[int, int]]) -> None:
    ra, rb = AttnRanges.from_ranges(a), AttnRanges.from_ranges(b)
    m = ra.merge()
    assert _set(m) == _set(ra) and m.is_sorted() and m.is_non_overlap()
    assert all(x.end < y.start for x, y in itertools.pairwise(m)), "touching ranges must fuse"
    assert _set(ra.intersect(rb)) == _set(ra) & _set(rb)
    assert _set(ra.find_hole_ranges(rb)) == _set(ra) - _set(rb)


@settings(max_examples=100, deadline=None)
@given(pairs, st.integers(1, 7))
def test_chunk_keeps_order_and_sizes(a: list[tuple[int, int]], size: int) -> None:
    r = AttnRanges.from_ranges(a)
    chunks = r.chunk(size)
    assert [t for c in chunks for t in c.token_ids()] == r.token_ids()
    assert all(c.total_seqlen == size for c in chunks[:-1])
    assert not chunks or 0 < chunks[-1].total_seqlen <= size


def test_cu_seqlens_round_trip_and_make_local() -> None:
    r = AttnRanges.from_cu_seqlens([0, 3, 3, 7, 12])
    assert r.to_list() == [[0, 3], [3, 7], [7, 12]]
    assert r.to_cu_seqlens() == [0, 3, 7, 12]
    host = AttnRanges.from_ranges([[8, 12], [0, 4]])  # local order: 8..11 then 0..3
    assert host.token_ids() == [8, 9, 10, 11, 0, 1, 2, 3]
    assert AttnRanges.from_ranges([[2, 4], [9, 11]]).make_local(host).to_list() == [[6, 8], [1, 3]]
    assert AttnRanges.from_ranges([[10, 12], [0, 2]]).make_local(host).to_list() == [[2, 6]]
    with pytest.raises(ValueError, match="not in"):
        AttnRanges.from_ranges([[4, 6]]).make_local(host)


def test_bad_ranges() -> None:
    with pytest.raises(ValueError, match="start <= end"):
        AttnRange(5, 2)
    with pytest.raises(ValueError, match="start <= end"):
        AttnRange(-1, 2)
    with pytest.raises(TypeError, match="start"):
        AttnRange(0.5, 2)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="non-decreasing"):
        AttnRanges.from_cu_seqlens([0, 5, 3])
    with pytest.raises(ValueError, match="start with 0"):
        AttnRanges.from_cu_seqlens([1, 5])
    with pytest.raises(ValueError, match="chunk_size"):
        AttnRanges.from_ranges([[0, 4]]).chunk(0)
    with pytest.raises(ValueError, match="contiguous"):
        AttnRanges.from_ranges([[0, 4], [5, 6]]).to_cu_seqlens()


def test_range_helpers() -> None:
    r = AttnRange(2, 6)
    assert r.seqlen == 4 and not r.is_empty() and AttnRange(3, 3).is_empty()
    assert r.intersect(AttnRange(4, 9)) == AttnRange(4, 6)
    assert r.intersect(AttnRange(7, 9)).is_empty()
    assert r.offset(3) == AttnRange(5, 9)
    rs = AttnRanges.from_ranges([[4, 6], [0, 2]])
    assert (
        len(rs) == 2
        and rs[1] == AttnRange(0, 2)
        and rs.total_seqlen == 4
        and rs.sort().to_list() == [[0, 2], [4, 6]]
    )


def test_from_bounds_equals_from_ranges_and_checks_like_attn_range() -> None:
    import numpy as np

    pairs = [[0, 4], [3, 3], [8, 12], [2, 100]]
    got = AttnRanges.from_bounds([p[0] for p in pairs], [p[1] for p in pairs])
    assert got == AttnRanges.from_ranges(pairs)
    starts, ends = np.array([0, 5]), np.array([1, 9])  # numpy ints go through the int rule
    assert AttnRanges.from_bounds(list(starts), list(ends)) == AttnRanges.from_ranges([[0, 1], [5, 9]])
    assert AttnRanges.from_bounds([], []) == AttnRanges()
    with pytest.raises(ValueError, match="differ in length"):
        AttnRanges.from_bounds([0, 1], [2])
    with pytest.raises(ValueError, match=r"0 <= start <= end, got \[5, 4\) at index 1"):
        AttnRanges.from_bounds([0, 5], [1, 4])
    with pytest.raises(ValueError, match="0 <= start"):
        AttnRanges.from_bounds([-1], [3])
    with pytest.raises(TypeError, match=r"`starts\[0\]` must be an int"):
        AttnRanges.from_bounds([True], [3])
    with pytest.raises(TypeError, match=r"`ends\[0\]` must be an int"):
        AttnRanges.from_bounds([0], [2.5])
