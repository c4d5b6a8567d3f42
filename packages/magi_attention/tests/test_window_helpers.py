"""infer_attn_mask_from_sliding_window / infer_attn_mask_from_cu_seqlens: exact against a per-element rule,
compact (a handful of slices per document)."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from magi_mask import dense_mask

import magi_attention.api as api


def _rule(sq: int, sk: int, left: int, right: int) -> np.ndarray:
    i, j = np.arange(sq)[:, None], np.arange(sk)[None, :]
    d = sk - sq  # bottom-right aligned diagonal, as FlashAttention
    lo = np.full_like(i, -(10**9)) if left == -1 else i + d - left
    hi = np.full_like(i, 10**9) if right == -1 else i + d + right
    return (j >= lo) & (j <= hi)


def _union(q, k, t, tq: int, tk: int) -> np.ndarray:
    qr = [[r.start, r.end] for r in q]
    kr = [[r.start, r.end] for r in k]
    return dense_mask(qr, kr, [x.code for x in t], tq, tk) > 0


@settings(max_examples=150, deadline=None)
@given(
    sq=st.integers(1, 40),
    sk=st.integers(1, 40),
    left=st.integers(-1, 45),
    right=st.integers(-1, 45),
    qs=st.integers(0, 5),
    ks=st.integers(0, 5),
)
def test_sliding_window_block_is_exact(sq, sk, left, right, qs, ks) -> None:
    q, k, t = api.infer_attn_mask_from_sliding_window((qs, qs + sq), (ks, ks + sk), (left, right))
    assert len(t) <= 3
    want = np.zeros((qs + sq, ks + sk), dtype=bool)
    want[qs:, ks:] = _rule(sq, sk, left, right)
    assert (_union(q, k, t, qs + sq, ks + sk) == want).all()


def test_cu_seqlens_self_and_cross() -> None:
    q, k, t, tq, tk = api.infer_attn_mask_from_cu_seqlens([0, 10, 30], [0, 10, 30], causal=True)
    assert (tq, tk) == (30, 30) and [x.value for x in t] == ["causal", "causal"]
    q, k, t, tq, tk = api.infer_attn_mask_from_cu_seqlens([0, 10, 30], [0, 4, 50], window_size=(5, 2))
    want = np.zeros((30, 50), dtype=bool)
    want[0:10, 0:4] = _rule(10, 4, 5, 2)
    want[10:30, 4:50] = _rule(20, 46, 5, 2)
    assert (_union(q, k, t, tq, tk) == want).all()
    with pytest.raises(ValueError, match="same number of documents"):
        api.infer_attn_mask_from_cu_seqlens([0, 10], [0, 5, 9])
    with pytest.raises(ValueError, match="window_size"):
        api.infer_attn_mask_from_sliding_window((0, 4), (0, 4), (-2, 0))


@settings(max_examples=60, deadline=None)
@given(
    lens=st.lists(st.tuples(st.integers(1, 30), st.integers(1, 30)), min_size=1, max_size=4),
    left=st.integers(-1, 12),
    right=st.integers(-1, 6),
    glob=st.integers(0, 8),
    causal=st.booleans(),
)
def test_cu_seqlens_with_global_window_is_exact(lens, left, right, glob, causal) -> None:
    cu_q, cu_k = [0], [0]
    for a, b in lens:
        cu_q.append(cu_q[-1] + a)
        cu_k.append(cu_k[-1] + b)
    q, k, t, tq, tk = api.infer_attn_mask_from_cu_seqlens(cu_q, cu_k, causal, (left, right), glob)
    want = np.zeros((tq, tk), dtype=bool)
    r = 0 if causal else right
    for qs, qe, ks, ke in zip(cu_q, cu_q[1:], cu_k, cu_k[1:]):
        sq, sk = qe - qs, ke - ks
        block = _rule(sq, sk, left, r)
        if glob:
            i, j = np.arange(sq)[:, None], np.arange(sk)[None, :]
            hi = np.full_like(i, 10**9) if r == -1 else i + (sk - sq) + r
            block |= (j < glob) & (j <= hi)
        want[qs:qe, ks:ke] = block
    assert (_union(q, k, t, tq, tk) == want).all()
