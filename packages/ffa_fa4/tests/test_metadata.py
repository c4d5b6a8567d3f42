"""Intervals, tile classes and block lists against dense masks built straight from the slices."""

from __future__ import annotations

import os
import random

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from magi_ffa_fa4._row_intervals import RowIntervals
from magi_ffa_fa4.blocks import EMPTY, FULL, PARTIAL, block_classes, build_block_meta
from magi_ffa_fa4.intervals import row_intervals, row_intervals_reference
from magi_ffa_fa4.testing import dense_mask, random_slices

# The Triton interval kernel runs on the GPU when there is one (the suite there sets TRITON_INTERPRET=0), else
# under the interpreter on CPU tensors.
TRITON_DEVICE = "cuda" if torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1" else "cpu"


def _on_triton_device(qr, kr, tm):
    return tuple(torch.tensor(x, dtype=torch.int32, device=TRITON_DEVICE) for x in (qr, kr, tm))


def _cpu(iv: RowIntervals) -> RowIntervals:
    return RowIntervals(iv.starts.cpu(), iv.ends.cpu(), iv.counts.cpu(), iv.width, iv.total_k)


def _dense_classes(mask: torch.Tensor, bm: int, bn: int) -> torch.Tensor:
    tq, tk = mask.shape
    out = torch.zeros(-(-tq // bm), -(-tk // bn), dtype=torch.int8)
    for m in range(out.shape[0]):
        for n in range(out.shape[1]):
            tile = mask[m * bm : (m + 1) * bm, n * bn : (n + 1) * bn]
            out[m, n] = EMPTY if not tile.any() else FULL if tile.all() else PARTIAL
    return out


def _check_intervals(iv, mask: torch.Tensor) -> None:
    assert torch.equal(iv.to_dense(), mask), "intervals do not reproduce the dense mask"
    # sorted, disjoint, non-touching, padding zeroed, width minimal
    c = iv.counts.long()
    assert iv.width == max(int(c.max()) if c.numel() else 0, 1)
    slot = torch.arange(iv.width)[None, :]
    used = slot < c[:, None]
    assert bool((iv.starts[used] < iv.ends[used]).all())
    assert bool((iv.starts[~used] == 0).all()) and bool((iv.ends[~used] == 0).all())
    if iv.width > 1:
        both = used[:, 1:]
        assert bool((iv.starts[:, 1:][both] > iv.ends[:, :-1][both]).all()), "intervals touch or are unsorted"
    # the interval count of a row equals the number of runs of visible keys
    runs = (mask[:, 1:] & ~mask[:, :-1]).sum(1) + mask[:, :1].sum(1) if mask.shape[1] else torch.zeros(0)
    assert torch.equal(c, runs.long()) if mask.shape[1] else True


@pytest.mark.parametrize("impl", ["torch", "triton"])
def test_four_types_one_slice(impl: str) -> None:
    # sq=3, sk=4 drawings from the AttnType docstring, then sq > sk for causal (first rows empty)
    use_triton = impl == "triton"
    cases = [
        (0, [[1, 1, 1, 1]] * 3),
        (1, [[1, 1, 0, 0], [1, 1, 1, 0], [1, 1, 1, 1]]),
        (2, [[1, 1, 1, 1], [0, 1, 1, 1], [0, 0, 1, 1]]),
        (3, [[1, 1, 0, 0], [0, 1, 1, 0], [0, 0, 1, 1]]),
    ]

    def intervals(qr, kr, tm, tq, tk):
        args = _on_triton_device(qr, kr, tm) if use_triton else (qr, kr, tm)
        return _cpu(row_intervals(*args, tq, tk, use_triton=use_triton))

    for t, want in cases:
        iv = intervals([[0, 3]], [[0, 4]], [t], 3, 4)
        assert iv.to_dense().int().tolist() == want, t
    iv = intervals([[0, 4]], [[0, 2]], [1], 4, 2)
    assert iv.to_dense().int().tolist() == [[0, 0], [0, 0], [1, 0], [1, 1]]
    iv = intervals([[0, 4]], [[0, 2]], [2], 4, 2)
    assert iv.to_dense().int().tolist() == [[1, 1], [0, 1], [0, 0], [0, 0]]


@settings(max_examples=150, deadline=None)
@given(
    seed=st.integers(0, 2**31 - 1),
    total_q=st.integers(1, 70),
    total_k=st.integers(1, 70),
    n=st.integers(0, 7),
)
def test_reference_intervals_match_dense(seed: int, total_q: int, total_k: int, n: int) -> None:
    qr, kr, tm = random_slices(random.Random(seed), total_q, total_k, n)
    iv = row_intervals_reference(qr, kr, tm, total_q, total_k)
    _check_intervals(iv, dense_mask(qr, kr, tm, total_q, total_k))


@pytest.mark.parametrize("seed", range(10))
def test_triton_intervals_match_reference(seed: int) -> None:
    rng = random.Random(seed)
    total_q, total_k = rng.randrange(40, 150), rng.randrange(1, 150)
    qr, kr, tm = random_slices(rng, total_q, total_k, rng.randrange(1, 10))
    ref = row_intervals_reference(qr, kr, tm, total_q, total_k)
    got = _cpu(row_intervals(*_on_triton_device(qr, kr, tm), total_q, total_k, use_triton=True))
    assert got.width == ref.width
    assert torch.equal(got.counts, ref.counts)
    assert torch.equal(got.starts, ref.starts) and torch.equal(got.ends, ref.ends)
    _check_intervals(got, dense_mask(qr, kr, tm, total_q, total_k))


def test_triton_capacity_retry() -> None:
    # 9 disjoint single-key intervals per row, then one wide slice bridging them: needs CAP > 4 on the way
    qr = [[0, 5]] * 9 + [[0, 2]]
    kr = [[2 * i, 2 * i + 1] for i in range(9)] + [[0, 17]]
    tm = [0] * 10
    got = _cpu(row_intervals(*_on_triton_device(qr, kr, tm), 5, 20, use_triton=True))
    ref = row_intervals_reference(qr, kr, tm, 5, 20)
    assert got.counts.tolist() == [1, 1, 9, 9, 9]
    assert torch.equal(got.starts, ref.starts) and torch.equal(got.ends, ref.ends)


@settings(max_examples=150, deadline=None)
@given(
    seed=st.integers(0, 2**31 - 1),
    total_q=st.integers(1, 90),
    total_k=st.integers(1, 90),
    n=st.integers(0, 6),
    bm=st.sampled_from([1, 4, 16, 32]),
    bn=st.sampled_from([1, 8, 16, 64]),
)
def test_block_classes_and_lists(seed: int, total_q: int, total_k: int, n: int, bm: int, bn: int) -> None:
    qr, kr, tm = random_slices(random.Random(seed), total_q, total_k, n)
    mask = dense_mask(qr, kr, tm, total_q, total_k)
    want = _dense_classes(mask, bm, bn)
    assert torch.equal(block_classes(qr, kr, tm, total_q, total_k, bm, bn), want)
    meta = build_block_meta(row_intervals_reference(qr, kr, tm, total_q, total_k), bm, bn)
    assert meta.has_empty_rows == bool((~mask.any(1)).any())
    # forward lists per m-block, backward lists per n-block, both ascending, both equal to the dense view
    for lists, view in ((meta.q2k, want), (meta.k2q, want.t())):
        for kind, cnt, off, idx in (
            (FULL, lists.full_cnt, lists.full_offset, lists.full_idx),
            (PARTIAL, lists.mask_cnt, lists.mask_offset, lists.mask_idx),
        ):
            assert off[0] == 0 and torch.equal(off[1:] - off[:-1], cnt.long())
            for r in range(view.shape[0]):
                got = idx[off[r] : off[r + 1]].tolist()
                assert got == (view[r] == kind).nonzero().flatten().tolist()
        for full in (True, False):
            tab = lists.padded(full)
            cnt = lists.full_cnt if full else lists.mask_cnt
            assert tab.shape[1] == max(int(cnt.max()), 1)
            for r in range(view.shape[0]):
                assert (
                    tab[r, : cnt[r]].tolist()
                    == (view[r] == (FULL if full else PARTIAL)).nonzero().flatten().tolist()
                )


def test_common_masks_are_cheap_and_exact() -> None:
    # causal 300 x 300 on 64 x 64 tiles: diagonal tiles Partial, below Full, above Empty (tails clipped)
    c = block_classes([[0, 300]], [[0, 300]], [1], 300, 300, 64, 64)
    m = torch.arange(5)
    want = torch.where(m[:, None] > m[None, :], FULL, torch.where(m[:, None] == m[None, :], PARTIAL, EMPTY))
    assert torch.equal(c, want.to(torch.int8))
    # full mask with uneven tails: every tile Full (out-of-range rows/keys do not count)
    assert bool((block_classes([[0, 130]], [[0, 70]], None, 130, 70, 64, 64) == FULL).all())


def test_bad_inputs_raise_value_error() -> None:
    with pytest.raises(ValueError, match="q_ranges"):
        row_intervals([[0, 5]], [[0, 2]], [0], 4, 2)
    with pytest.raises(ValueError, match="k_ranges"):
        row_intervals([[0, 2]], [[1, 0]], [0], 4, 2)
    with pytest.raises(ValueError, match="attn_type_map"):
        row_intervals([[0, 2]], [[0, 2]], [4], 4, 2)
    with pytest.raises(ValueError, match="attn_type_map"):
        row_intervals([[0, 2]], [[0, 2]], [0, 1], 4, 2)
    with pytest.raises(ValueError, match="same number"):
        row_intervals([[0, 2]], [[0, 2], [0, 1]], None, 4, 2)
    with pytest.raises(ValueError, match="block_m"):
        block_classes([[0, 2]], [[0, 2]], None, 4, 2, 0, 16)
    with pytest.raises(ValueError, match="q_ranges"):
        row_intervals(torch.zeros(2, 3, dtype=torch.int32), [[0, 2]], None, 4, 2)
