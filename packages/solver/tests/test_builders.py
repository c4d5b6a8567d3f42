"""Mask builders against predicates written straight from their definitions."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from magi_solver import solve_dispatch
from magi_solver.builders import (
    make_block_causal_mask,
    make_global_window_mask,
    make_prefix_lm_mask,
    make_shared_question_mask,
    make_sliding_window_mask,
    make_varlen_causal_mask,
    make_varlen_full_mask,
)
from magi_solver.mask import normalize_mask
from magi_solver.testing import ascii_mask, dense_mask

CU = [0, 5, 6, 17, 30]
N = CU[-1]


def _doc_of() -> np.ndarray:
    doc = np.zeros(N, dtype=int)
    for i, (a, b) in enumerate(itertools.pairwise(CU)):
        doc[a:b] = i
    return doc


def _pred(fn) -> np.ndarray:
    doc = _doc_of()
    start = np.asarray([CU[d] for d in doc])
    q = np.arange(N)[:, None]
    k = np.arange(N)[None, :]
    same = doc[:, None] == doc[None, :]
    return same & fn(q, k, start[:, None])


def _check(spec, expect: np.ndarray) -> None:
    q, k, t = spec  # unpacks as a 3-tuple
    normalize_mask(q, k, t, N, N)  # no shared pairs, all in bounds
    d = dense_mask(q, k, t, N, N)
    assert d.max() <= 1
    assert (d.astype(bool) == expect).all()
    assert (spec.to_dense(N) == expect).all()


def test_varlen_full_and_causal() -> None:
    _check(make_varlen_full_mask(CU), _pred(lambda q, k, s: np.ones_like(q * k, dtype=bool)))
    _check(make_varlen_causal_mask(CU), _pred(lambda q, k, s: k <= q))
    assert make_varlen_causal_mask(CU).num_slices == 4


@pytest.mark.parametrize("window", [(3, 0), (2, 4), (0, 0), (-1, 2), (5, -1), (-1, -1), (40, 40)])
def test_sliding_window(window: tuple[int, int]) -> None:
    left, right = window

    def fn(q, k, s):
        ok = np.ones_like(q * k, dtype=bool)
        if left >= 0:
            ok &= k >= q - left
        if right >= 0:
            ok &= k <= q + right
        return ok

    spec = make_sliding_window_mask(CU, window)
    _check(spec, _pred(fn))
    assert spec.num_slices <= 3 * 4


@pytest.mark.parametrize(("window", "g"), [((2, 0), 2), ((1, 1), 3), ((0, 0), 0), ((3, -1), 20)])
def test_global_window(window: tuple[int, int], g: int) -> None:
    left, right = window

    def fn(q, k, s):
        win = k >= q - left
        if right >= 0:
            win &= k <= q + right
        glob = k < s + g
        if right >= 0:
            glob &= k <= q + right
        return win | glob

    _check(make_global_window_mask(CU, window, g), _pred(fn))


@pytest.mark.parametrize("bs", [1, 3, 4, 100])
def test_block_causal(bs: int) -> None:
    _check(make_block_causal_mask(CU, bs), _pred(lambda q, k, s: (k - s) // bs <= (q - s) // bs))


@pytest.mark.parametrize("prefix", [0, 2, [1, 0, 11, 13]])
def test_prefix_lm(prefix) -> None:
    p = prefix if isinstance(prefix, list) else [min(prefix, b - a) for a, b in itertools.pairwise(CU)]
    plen = np.zeros(N, dtype=int)
    for (a, b), x in zip(itertools.pairwise(CU), p):
        plen[a:b] = x
    spec = make_prefix_lm_mask(CU, p)
    _check(spec, _pred(lambda q, k, s: (k < s + plen[:, None]) | (k <= q)))


def test_shared_question() -> None:
    spec = make_shared_question_mask([4, 3], [[2, 5], [6, 1, 3]])
    # sample 0: q [0,4) a [4,6) [6,11); sample 1: q [11,14) a [14,20) [20,21) [21,24)
    n = 24
    seg = [(0, 4, 0), (4, 6, 0), (6, 11, 0), (11, 14, 11), (14, 20, 11), (20, 21, 11), (21, 24, 11)]
    expect = np.zeros((n, n), dtype=bool)
    for a, b, q0 in seg:
        for q in range(a, b):
            expect[q, a : q + 1] = True  # causal inside the segment
            if a != q0:
                expect[q, q0 : q0 + (4 if q0 == 0 else 3)] = True  # the question
    q, k, t = spec
    assert (dense_mask(q, k, t, n, n) == expect).all()
    solve_dispatch(q, k, t, n, 2, 3)  # a valid dispatch input


@pytest.mark.parametrize(
    ("call", "match"),
    [
        pytest.param(lambda: make_sliding_window_mask(CU, (-2, 0)), "window", id="window-negative"),
        pytest.param(lambda: make_sliding_window_mask(CU, 3), "window", id="window-not-pair"),
        pytest.param(lambda: make_block_causal_mask(CU, 0), "block_size", id="block-zero"),
        pytest.param(lambda: make_prefix_lm_mask(CU, [1, 2]), "prefix_lens", id="prefix-count"),
        pytest.param(lambda: make_prefix_lm_mask(CU, [1, 1, 3, 99]), r"prefix_lens\[3\]", id="prefix-long"),
        pytest.param(lambda: make_global_window_mask(CU, (1, 0), -1), "num_global", id="global-negative"),
        pytest.param(lambda: make_varlen_causal_mask([0, 5, 3]), "cu_seqlens", id="cu-decreasing"),
        pytest.param(lambda: make_shared_question_mask([0], [[1]]), "question_lens", id="question-empty"),
        pytest.param(lambda: make_shared_question_mask([2], [[1], [2]]), "differ", id="sample-count"),
    ],
)
def test_builders_reject(call, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        call()


def test_ascii_mask_draws_a_sliding_window() -> None:
    q, k, t = make_sliding_window_mask([0, 5], (1, 0))
    assert ascii_mask(q, k, t, 5) == "#....\n##...\n.##..\n..##.\n...##"
    assert ascii_mask([[0, 2], [0, 2]], [[0, 2], [0, 2]], 0, 2) == "22\n22"


def test_long_tailed_cu_seqlens() -> None:
    """Packed documents from 0 to total, each 128 .. total / 4 tokens but the cut last one, the same for a
    seed and another for another seed; a non-positive total is refused."""
    from magi_solver import long_tailed_cu_seqlens

    total = 65536
    cu = long_tailed_cu_seqlens(total)
    lens = [b - a for a, b in itertools.pairwise(cu)]
    assert cu[0] == 0 and cu[-1] == total and len(lens) > 4
    assert all(128 <= n <= total // 4 for n in lens[:-1]) and 0 < lens[-1] <= total // 4
    assert long_tailed_cu_seqlens(total) == cu and long_tailed_cu_seqlens(total, seed=1) != cu
    assert long_tailed_cu_seqlens(100) == [0, 100]
    with pytest.raises(ValueError, match="total"):
        long_tailed_cu_seqlens(0)
