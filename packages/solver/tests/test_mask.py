"""Mask algebra: exact areas, clipping and decomposition against dense masks built from the definitions."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from magi_mask import region_dense

from magi_solver import AttnMaskType, AttnRange, AttnSlice, SliceList
from magi_solver.mask import (
    band_area,
    band_area_np,
    decompose_region,
    normalize_mask,
    region_of,
    tighten_region,
)
from magi_solver.testing import dense_mask

N = 16


def _dense_region(r: tuple[int, ...], n: int = N) -> np.ndarray:
    return region_dense(r, n, n)


def _typed_dense(slices: list[tuple[int, int, int, int, int]], n: int = N) -> np.ndarray:
    if not slices:
        return np.zeros((n, n), dtype=np.int64)
    return dense_mask([s[:2] for s in slices], [s[2:4] for s in slices], [s[4] for s in slices], n, n)


regions = st.tuples(
    st.integers(0, N),
    st.integers(0, N),
    st.integers(0, N),
    st.integers(0, N),
    st.integers(-N - 2, N + 2),
    st.integers(-N - 2, N + 2),
).map(lambda t: (min(t[0], t[1]), max(t[0], t[1]), min(t[2], t[3]), max(t[2], t[3]), t[4], t[5]))
typed = st.tuples(
    st.integers(0, N - 1), st.integers(1, N), st.integers(0, N - 1), st.integers(1, N), st.integers(0, 3)
).map(lambda t: (t[0], max(t[0] + 1, t[1]), t[2], max(t[2] + 1, t[3]), t[4]))


@settings(max_examples=1500, deadline=None)
@given(regions)
def test_band_area_tighten_decompose_match_dense(r: tuple[int, ...]) -> None:
    d = _dense_region(r)
    assert band_area(*r) == d.sum()
    assert int(band_area_np(*r)) == d.sum()
    t = tighten_region(*r)
    if t is None:
        assert d.sum() == 0
        return
    assert (_dense_region(t) == d).all(), "tightening changed the region"
    # every row and column of the tightened rectangle holds a pair
    sub = d[t[0] : t[1], t[2] : t[3]]
    assert sub.any(axis=1).all() and sub.any(axis=0).all()
    parts = decompose_region(t)
    assert 1 <= len(parts) <= 3
    assert (_typed_dense(parts) == d).all(), f"decomposition of {t} into {parts} is not exact"


@settings(max_examples=1000, deadline=None)
@given(typed, st.integers(0, N), st.integers(0, N), st.booleans())
def test_clip_preserves_dense_mask(s: tuple[int, ...], a: int, b: int, along_q: bool) -> None:
    a, b = min(a, b), max(a, b)
    sl = AttnSlice(AttnRange(s[0], s[1]), AttnRange(s[2], s[3]), AttnMaskType.from_any(s[4]))
    full = _typed_dense([tuple(s)])
    assert sl.area() == full.sum()
    parts = sl.clip_q(a, b) if along_q else sl.clip_k(a, b)
    expect = np.zeros_like(full)
    if along_q:
        expect[a:b] = full[a:b]
    else:
        expect[:, a:b] = full[:, a:b]
    got = _typed_dense(
        [(p.q_range.start, p.q_range.end, p.k_range.start, p.k_range.end, p.mask_type.code) for p in parts]
    )
    assert (got == expect).all()
    assert sum(p.area() for p in parts) == expect.sum()


@pytest.mark.parametrize(
    ("t", "expect"),
    [
        pytest.param(0, [[1, 1, 1, 1, 1]] * 3, id="full"),
        pytest.param(1, [[1, 1, 1, 0, 0], [1, 1, 1, 1, 0], [1, 1, 1, 1, 1]], id="causal-bottom-right"),
        pytest.param(2, [[1, 1, 1, 1, 1], [0, 1, 1, 1, 1], [0, 0, 1, 1, 1]], id="inv-causal-top-left"),
        pytest.param(3, [[1, 1, 1, 0, 0], [0, 1, 1, 1, 0], [0, 0, 1, 1, 1]], id="bi-causal"),
    ],
)
def test_type_alignment_3x5(t: int, expect: list[list[int]]) -> None:
    s = AttnSlice(AttnRange(0, 3), AttnRange(0, 5), t)
    assert s.to_dense().astype(int).tolist() == expect
    assert dense_mask([[0, 3]], [[0, 5]], t, 3, 5).tolist() == expect
    assert s.area() == sum(map(sum, expect))


def test_causal_taller_than_wide_has_empty_top_rows() -> None:
    s = AttnSlice(AttnRange(0, 5), AttnRange(0, 3), AttnMaskType.CAUSAL)
    assert s.to_dense().astype(int).tolist() == [[0, 0, 0], [0, 0, 0], [1, 0, 0], [1, 1, 0], [1, 1, 1]]
    assert AttnSlice(AttnRange(0, 5), AttnRange(0, 3), "bi_causal").area() == 0


@pytest.mark.parametrize("value", ["causal", "CAUSAL", " Causal ", 1, np.int32(1), AttnMaskType.CAUSAL])
def test_mask_type_from_any(value: object) -> None:
    assert AttnMaskType.from_any(value) is AttnMaskType.CAUSAL
    assert int(AttnMaskType.from_any(value)) == 1


@pytest.mark.parametrize(
    ("value", "exc"),
    [
        ("sliding", ValueError),
        (4, ValueError),
        (-1, ValueError),
        (True, TypeError),
        (1.0, TypeError),
        (None, TypeError),
    ],
)
def test_mask_type_bad(value: object, exc: type[Exception]) -> None:
    with pytest.raises(exc, match="attn_mask_type"):
        AttnMaskType.from_any(value)


def test_region_of_types() -> None:
    assert region_of(0, 3, 0, 5, 1)[5] == 2 and region_of(0, 3, 0, 5, 2)[4] == 0


def test_slicelist_helpers() -> None:
    sl = SliceList(((0, 3), (3, 5)), ((0, 5), (0, 2)), (1, 0))
    assert len(sl) == 2 and not sl.is_empty and SliceList().is_empty
    assert sl.area() == 12 + 4
    assert sl.to_dense(5, 5).sum() == 16
    assert [s.mask_type for s in sl.to_slices()] == [AttnMaskType.CAUSAL, AttnMaskType.FULL]
    with pytest.raises(ValueError, match="equal lengths"):
        SliceList(((0, 1),), (), ())


@pytest.mark.parametrize(
    ("q", "k", "t", "match"),
    [
        pytest.param([[0, 4]], [[0, 4]], "nope", "attn_mask_type", id="unknown-type"),
        pytest.param([[0, 4]], [[0, 4]], [0, 1], "one per slice", id="type-list-length"),
        pytest.param([[0, 4], [4, 8]], [[0, 4]], 0, "same length", id="length-mismatch"),
        pytest.param([[3, 3]], [[0, 4]], 0, r"q_ranges\[0\].*empty", id="empty-q"),
        pytest.param([[0, 4]], [[5, 2]], 0, r"k_ranges\[0\].*empty or negative", id="negative-k"),
        pytest.param([[0, 4], [0, 17]], [[0, 4], [0, 1]], 0, r"q_ranges\[1\].*outside", id="q-outside"),
        pytest.param([[0, 4]], [[-1, 4]], 0, r"k_ranges\[0\].*outside", id="k-negative-start"),
        pytest.param([[0, 4, 5]], [[0, 4]], 0, r"q_ranges\[0\].*pair", id="not-a-pair"),
    ],
)
def test_normalize_mask_rejects(q: object, k: object, t: object, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        normalize_mask(q, k, t, 16, 16)


def test_normalize_mask_accepts_overlapping_ranges_with_disjoint_pairs() -> None:
    # q ranges overlap, k ranges overlap, but the causal and inv-causal halves share only... nothing
    q = [[0, 8], [0, 8]]
    k = [[0, 8], [1, 9]]
    out = normalize_mask(q, k, [1, 2], 16, 16)  # causal keeps k <= q; inv-causal on [1, 9) keeps k >= q + 1
    assert len(out) == 2
    assert dense_mask(q, k, [1, 2], 16, 16).max() == 1


@settings(max_examples=200, deadline=None)
@given(st.data())
def test_slices_sharing_pairs_become_a_disjoint_union(data: st.DataObject) -> None:
    """The mask is the union of its slices: shared pairs are cut out once, the union is unchanged."""
    total = data.draw(st.integers(2, 24))
    n = data.draw(st.integers(1, 6))
    q, k, t = [], [], []
    for _ in range(n):
        qs = data.draw(st.integers(0, total - 1))
        ks = data.draw(st.integers(0, total - 1))
        q.append([qs, data.draw(st.integers(qs + 1, total))])
        k.append([ks, data.draw(st.integers(ks + 1, total))])
        t.append(data.draw(st.integers(0, 3)))
    union = dense_mask(q, k, t, total, total) > 0
    rewritten = normalize_mask(q, k, t, total, total)
    counts = dense_mask(
        [s[:2] for s in rewritten], [s[2:4] for s in rewritten], [s[4] for s in rewritten], total, total
    )
    assert counts.max(initial=0) <= 1, "a pair is still covered twice"
    assert np.array_equal(counts > 0, union), "the rewrite changed the union"
