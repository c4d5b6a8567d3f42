"""Band-region algebra against the dense oracle, and the oracle against the drawings of the types."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from magi_mask import (
    as_int_pairs,
    band_area,
    band_area_np,
    clip_region,
    decompose_region,
    dense_mask,
    disjoint_union,
    region_dense,
    region_of,
    slice_dense,
    subtract_region,
    tighten_region,
    total_area,
    validate_slices,
)

N = 14

regions = st.tuples(*(st.integers(0, N),) * 4, st.integers(-N - 2, N + 2), st.integers(-N - 2, N + 2)).map(
    lambda t: (min(t[0], t[1]), max(t[0], t[1]), min(t[2], t[3]), max(t[2], t[3]), t[4], t[5])
)


def _typed_dense(slices) -> np.ndarray:
    if not slices:
        return np.zeros((N, N), dtype=np.int64)
    return dense_mask(
        [s[:2] for s in slices], [s[2:4] for s in slices], [s[4] for s in slices], N, N, count=True
    )


def test_slice_dense_matches_the_drawings() -> None:
    # sq=3, sk=5 drawn in magi_mask.types
    want = {
        "full": ["11111", "11111", "11111"],
        "causal": ["11100", "11110", "11111"],
        "inv_causal": ["11111", "01111", "00111"],
        "bi_causal": ["11100", "01110", "00111"],
    }
    for t, rows in want.items():
        got = ["".join("1" if x else "0" for x in row) for row in slice_dense(3, 5, t)]
        assert got == rows, t


@settings(max_examples=800, deadline=None)
@given(regions, st.integers(0, N), st.integers(0, N))
def test_area_tighten_clip_decompose(r, a, b) -> None:
    d = region_dense(r, N, N)
    assert band_area(*r) == d.sum() == int(band_area_np(*r))
    t = tighten_region(*r)
    assert (t is None) == (d.sum() == 0)
    if t is None:
        return
    assert (region_dense(t, N, N) == d).all()
    assert (_typed_dense(decompose_region(t)) == d).all(), "decomposition is not exact"
    a, b = min(a, b), max(a, b)
    c = clip_region(t, a, b, 0, N)
    want = d.copy()
    want[:a] = want[b:] = False
    assert (region_dense(c, N, N) if c else np.zeros_like(d)).sum() == want.sum()


@settings(max_examples=400, deadline=None)
@given(regions, regions)
def test_subtract(p, s) -> None:
    p, s = tighten_region(*p), tighten_region(*s)
    if p is None or s is None:
        return
    pieces = subtract_region(p, s)
    got = np.zeros((N, N), dtype=np.int64)
    for x in pieces:
        got += region_dense(x, N, N)
    assert got.max(initial=0) <= 1
    assert (got.astype(bool) == (region_dense(p, N, N) & ~region_dense(s, N, N))).all()


@settings(max_examples=300, deadline=None)
@given(st.lists(st.tuples(st.integers(0, N - 1), st.integers(1, N), st.integers(0, N - 1), st.integers(1, N),
                          st.integers(0, 3)), min_size=1, max_size=6))  # fmt: skip
def test_disjoint_union_keeps_the_union(raw) -> None:
    slices = [(a, max(a + 1, b), c, max(c + 1, d), t) for a, b, c, d, t in raw]
    out = disjoint_union(slices)
    assert _typed_dense(out).max() <= 1
    assert ((_typed_dense(out) > 0) == (_typed_dense(slices) > 0)).all()
    assert total_area(out) == int((_typed_dense(slices) > 0).sum())
    if _typed_dense(slices).max() <= 1:
        assert out == slices, "a disjoint mask must come back unchanged"


def test_region_of_types() -> None:
    assert region_of(0, 3, 0, 5, 1)[5] == 2 and region_of(0, 3, 0, 5, 2)[4] == 0


class _R:
    def __init__(self, s: int, e: int) -> None:
        self.start, self.end = s, e


def test_as_int_pairs_forms() -> None:
    assert as_int_pairs([[0, 2], range(2, 4), _R(4, 6)], "q") == [(0, 2), (2, 4), (4, 6)]
    assert as_int_pairs(np.array([[1, 2]]), "q") == [(1, 2)]
    with pytest.raises(TypeError, match="list of"):
        as_int_pairs("0-4", "q_ranges")
    with pytest.raises(ValueError, match=r"q_ranges\[0\].*pair"):
        as_int_pairs([[0, 1, 2]], "q_ranges")
    with pytest.raises(TypeError, match="int"):
        as_int_pairs([[0, 1.5]], "q_ranges")


@pytest.mark.parametrize(
    ("q", "k", "t", "kw", "match"),
    [
        pytest.param([[3, 3]], [[0, 4]], 0, {}, r"q_ranges\[0\].*empty", id="empty-q"),
        pytest.param([[0, 4]], [[5, 2]], 0, {"allow_empty": True}, r"k_ranges\[0\].*negative", id="neg-k"),
        pytest.param([[0, 17]], [[0, 4]], 0, {}, r"q_ranges\[0\].*outside", id="outside"),
        pytest.param([[0, 4], [4, 8]], [[0, 4]], 0, {}, "same number", id="length"),
        pytest.param([[0, 4]], [[0, 4]], "nope", {}, "unknown mask type", id="type"),
    ],
)
def test_validate_slices_rejects(q, k, t, kw, match) -> None:
    with pytest.raises(ValueError, match=match):
        validate_slices(q, k, t, 16, 16, **kw)


def test_dense_mask_bool_and_count() -> None:
    m = dense_mask([[0, 4], [0, 4]], [[0, 4], [0, 4]], ["causal", "full"], 4, 4, count=True)
    assert m.max() == 2 and m.dtype == np.int64
    b = dense_mask([[0, 4], [2, 2]], [[0, 4], [0, 4]], [1, 0], 4, 4)
    assert b.dtype == bool and b.sum() == 10
