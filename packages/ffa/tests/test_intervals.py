"""Row intervals (torch reference and Triton kernel) against dense masks built straight from the slices."""

from __future__ import annotations

import os
import random

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from magi_ffa.intervals import RowIntervals, row_intervals, row_intervals_reference
from magi_ffa.testing import make_attn_mask as dense_mask
from magi_ffa.testing import random_overlapping_slices

# The Triton interval kernel runs on the GPU when there is one (the suite there sets TRITON_INTERPRET=0), else
# under the interpreter on CPU tensors.
TRITON_DEVICE = "cuda" if torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1" else "cpu"


def _on_triton_device(qr, kr, tm):
    return tuple(torch.tensor(x, dtype=torch.int32, device=TRITON_DEVICE) for x in (qr, kr, tm))


def _cpu(iv: RowIntervals) -> RowIntervals:
    return RowIntervals(iv.starts.cpu(), iv.ends.cpu(), iv.counts.cpu(), iv.width, iv.total_k)


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
    # sq=3, sk=4 drawings from the AttnMaskType docstring, then sq > sk for causal (first rows empty)
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
    qr, kr, tm = random_overlapping_slices(random.Random(seed), total_q, total_k, n)
    iv = row_intervals_reference(qr, kr, tm, total_q, total_k)
    _check_intervals(iv, dense_mask(qr, kr, tm, total_q, total_k))


@pytest.mark.parametrize("seed", range(10))
def test_triton_intervals_match_reference(seed: int) -> None:
    rng = random.Random(seed)
    total_q, total_k = rng.randrange(40, 150), rng.randrange(1, 150)
    qr, kr, tm = random_overlapping_slices(rng, total_q, total_k, rng.randrange(1, 10))
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
    with pytest.raises(ValueError, match="q_ranges"):
        row_intervals(torch.zeros(2, 3, dtype=torch.int32), [[0, 2]], None, 4, 2)
    with pytest.raises(ValueError, match="total_q"):
        row_intervals([[0, 2]], [[0, 2]], None, -1, 2)
