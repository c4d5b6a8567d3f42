"""Tile classes and block lists against dense masks built straight from the slices (the row intervals they
start from are magi_ffa's, tested there)."""

from __future__ import annotations

import random

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from magi_ffa.intervals import row_intervals_reference
from magi_ffa_fa4.blocks import EMPTY, FULL, PARTIAL, block_classes, build_block_meta
from magi_ffa_fa4.testing import dense_mask, random_overlapping_slices


def _dense_classes(mask: torch.Tensor, bm: int, bn: int) -> torch.Tensor:
    tq, tk = mask.shape
    out = torch.zeros(-(-tq // bm), -(-tk // bn), dtype=torch.int8)
    for m in range(out.shape[0]):
        for n in range(out.shape[1]):
            tile = mask[m * bm : (m + 1) * bm, n * bn : (n + 1) * bn]
            out[m, n] = EMPTY if not tile.any() else FULL if tile.all() else PARTIAL
    return out


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
    qr, kr, tm = random_overlapping_slices(random.Random(seed), total_q, total_k, n)
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
    with pytest.raises(ValueError, match="block_m"):
        block_classes([[0, 2]], [[0, 2]], None, 4, 2, 0, 16)
    with pytest.raises(ValueError, match="q_ranges"):
        block_classes([[0, 5]], [[0, 2]], [0], 4, 2, 16, 16)
