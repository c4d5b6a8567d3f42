"""Mask builders against predicates written straight from their definitions."""

from __future__ import annotations

import itertools
import statistics

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
from magi_solver.mask import AttnMaskType, normalize_mask
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


def test_lognormal_doc_lengths_fill_and_count() -> None:
    """Drawn until full: every length in [floor, cap] units of `unit` but the cut last one, summing to total;
    a fixed count: `num_docs` lengths >= floor summing to total. Bad arguments name themselves."""
    from magi_solver import lognormal_doc_lengths

    lens = lognormal_doc_lengths(100_000, median=300, sigma=1.2, seed=4, floor=2, cap=40, unit=50)
    assert sum(lens) == 100_000 and len(lens) > 50
    assert all(n % 50 == 0 and 100 <= n <= 2000 for n in lens[:-1]) and 0 < lens[-1] <= 2000
    assert lognormal_doc_lengths(0, median=5) == []
    lens = lognormal_doc_lengths(1000, seed=1, num_docs=30, floor=3)
    assert len(lens) == 30 and sum(lens) == 1000 and min(lens) >= 3
    for kwargs, name in [
        ({"median": 0}, "median"),
        ({"median": 5, "sigma": -1}, "sigma"),
        ({"median": 5, "floor": 0}, "floor"),
        ({"median": 5, "unit": 0}, "unit"),
        ({}, "median"),
        ({"num_docs": 0}, "num_docs"),
        ({"num_docs": 2000}, "num_docs"),
        ({"num_docs": 3, "cap": 5}, "cap"),
    ]:
        with pytest.raises(ValueError, match=name):
            lognormal_doc_lengths(1000, **kwargs)
    with pytest.raises(TypeError, match="total"):
        lognormal_doc_lengths(10.5, median=5)


@pytest.mark.parametrize(
    "name, median_tokens",
    [("docs4k_causal", 4096), ("short_docs_causal", 512), ("video_clips", 16 * 1560)],
)
def test_family_lengths_have_their_median(name: str, median_tokens: int) -> None:
    """Over many draws (seeds 0-9 of 4M tokens, the cut last documents left out) the median length is the
    family's within 10 %, and no length passes the cap (65,536 tokens; video: 8 to 32 frames)."""
    from magi_solver import family_doc_lengths

    lens = [n for seed in range(10) for n in family_doc_lengths(name, 1 << 22, seed)[:-1]]
    assert len(lens) > 400
    assert abs(statistics.median(lens) / median_tokens - 1) < 0.10
    if name == "video_clips":
        assert all(n % 1560 == 0 and 8 <= n // 1560 <= 32 for n in lens)
    else:
        assert max(lens) <= 65536 and min(lens) >= 1


@pytest.mark.parametrize("name", ["full", "causal", "docs4k_causal", "docs4k_full", "short_docs_causal",
                                  "docs4k_window2048", "video_clips"])  # fmt: skip
def test_family_masks_are_their_documents(name: str) -> None:
    """Every family mask is exactly its documents' mask (dense, 6,000 tokens; video: 60,000 tokens by its
    slices), the lengths sum to the total, the same for a seed; a larger total (another cp size) draws the
    same leading documents."""
    from magi_solver import FAMILY_MASKS, family_doc_lengths, make_family_mask

    assert name in FAMILY_MASKS
    total = 60_000 if name == "video_clips" else 6000
    lens = family_doc_lengths(name, total, seed=5)
    assert sum(lens) == total and all(n > 0 for n in lens)
    spec = make_family_mask(name, total, seed=5)
    assert make_family_mask(name, total, seed=5) == spec
    cu = [0, *itertools.accumulate(lens)]
    if name == "video_clips":
        assert len(lens) >= 2 and all(n % 1560 == 0 for n in lens[:-1])
        frames = [(a, min(a + 1560, e), s) for s, e in itertools.pairwise(cu) for a in range(s, e, 1560)]
        got = sorted((q.start, q.end, k.start, k.end, t.code) for q, k, t in zip(*spec))
        assert got == sorted((a, b, s, b, AttnMaskType.FULL.code) for a, b, s in frames)
    else:
        i = np.arange(total)[:, None]
        j = np.arange(total)[None, :]
        doc = np.repeat(np.arange(len(lens)), lens)
        want = doc[:, None] == doc[None, :]
        if "causal" in name or "window" in name:
            want &= j <= i
        if "window" in name:
            want &= i - j < 2048
        assert (spec.to_dense(total) == want).all()
    if name in ("full", "causal"):
        assert lens == [total]
    else:
        assert family_doc_lengths(name, total, seed=6) != lens
        bigger = family_doc_lengths(name, 4 * total, seed=5)
        assert bigger[: len(lens) - 1] == lens[:-1]
    with pytest.raises(ValueError, match="unknown mask family"):
        make_family_mask("docs4k", total)
