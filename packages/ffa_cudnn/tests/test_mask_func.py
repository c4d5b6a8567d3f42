"""Row intervals -> cuDNN's mask_func, decoded back and compared with dense masks built from the slices."""

from __future__ import annotations

import random

import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from magi_ffa_cudnn import mask_func_from_intervals, visible_from_mask_func

from magi_ffa.intervals import RowIntervals, row_intervals_reference
from magi_ffa.testing import make_attn_mask, random_overlapping_slices


def _check(func: torch.Tensor, iv: RowIntervals, mask: torch.Tensor) -> None:
    assert func.dtype == torch.int32 and func.is_contiguous()
    assert func.ndim == 3 and func.shape[0] == 1 and func.shape[2] == mask.shape[0]
    assert func.shape[1] % 2 == 1, "nfunc must be odd"
    f = func[0].t().long()
    assert bool((f >= 0).all()) and bool((f <= mask.shape[1]).all()), "endpoints outside [0, total_k]"
    if f.shape[1] > 1:
        assert bool((f[:, 1:] >= f[:, :-1]).all()), "endpoints must be nondecreasing"
    assert torch.equal(visible_from_mask_func(func, mask.shape[1]), mask)
    # the shorter encoding whenever every non-empty row starts at key 0
    lead0 = bool(((iv.starts[:, 0] == 0) | (iv.counts == 0)).all())
    assert func.shape[1] == (2 * iv.width - 1 if lead0 else 2 * iv.width + 1)


@settings(max_examples=200, deadline=None)
@given(
    seed=st.integers(0, 2**31 - 1),
    total_q=st.integers(1, 60),
    total_k=st.integers(1, 60),
    n=st.integers(0, 8),
)
def test_random_overlapping_slices(seed: int, total_q: int, total_k: int, n: int) -> None:
    qr, kr, tm = random_overlapping_slices(random.Random(seed), total_q, total_k, n)
    iv = row_intervals_reference(qr, kr, tm, total_q, total_k)
    _check(mask_func_from_intervals(iv), iv, make_attn_mask(qr, kr, tm, total_q, total_k))


def test_common_masks() -> None:
    # causal over the whole sequence: one interval starting at 0 -> nfunc 1
    iv = row_intervals_reference([[0, 6]], [[0, 6]], [1], 6, 6)
    func = mask_func_from_intervals(iv)
    assert func.shape == (1, 1, 6) and func[0, 0].tolist() == [1, 2, 3, 4, 5, 6]
    # two causal documents: the second starts at key 3 -> a leading empty interval, nfunc 3
    iv = row_intervals_reference([[0, 3], [3, 5]], [[0, 3], [3, 5]], [1, 1], 5, 5)
    func = mask_func_from_intervals(iv)
    assert func.shape == (1, 3, 5)
    assert func[0].t().tolist() == [[0, 0, 1], [0, 0, 2], [0, 0, 3], [0, 3, 4], [0, 3, 5]]
    _check(func, iv, make_attn_mask([[0, 3], [3, 5]], [[0, 3], [3, 5]], [1, 1], 5, 5))


def test_rows_without_keys_and_empty_problem() -> None:
    # rows 0-1 see nothing, rows 2-3 see [1, 3) and [5, 6): gaps stay hidden, empty rows are all zeros
    qr, kr, tm = [[2, 4], [2, 4]], [[1, 3], [5, 6]], [0, 0]
    iv = row_intervals_reference(qr, kr, tm, 4, 6)
    func = mask_func_from_intervals(iv)
    _check(func, iv, make_attn_mask(qr, kr, tm, 4, 6))
    assert func[0, :, :2].eq(0).all()
    z = row_intervals_reference([], [], None, 0, 5)
    assert mask_func_from_intervals(z).shape == (1, 1, 0)
