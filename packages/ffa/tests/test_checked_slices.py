"""The internal entry of callers that check their slices once (`check_slices`, `ffa_fwd_checked` /
`ffa_bwd_checked`): the same results as the public launchers, which keep every check."""

from __future__ import annotations

import pytest
import torch

from magi_ffa import ffa_bwd, ffa_fwd
from magi_ffa._ops import ffa_bwd_checked, ffa_fwd_checked
from magi_ffa.validation import check_slices

QR = [[0, 20], [20, 48], [10, 30]]
KR = [[0, 24], [8, 40], [30, 40]]
TYPES = [1, 0, 3]


def _inputs(dtype, tq=48, tk=40, hq=4, hk=2, d=16):
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(tq, hq, d, dtype=dtype, generator=gen)
    k, v = (torch.randn(tk, hk, d, dtype=dtype, generator=gen) for _ in range(2))
    do = torch.randn(tq, hq, d, dtype=dtype, generator=gen)
    return q, k, v, do


@pytest.mark.parametrize(("backend", "dtype"), [("torch", torch.float64), ("triton", torch.float32)])
def test_checked_launchers_match_the_public_ones(backend: str, dtype: torch.dtype, monkeypatch) -> None:
    if backend == "triton":
        monkeypatch.setenv("TRITON_INTERPRET", "1")
    q, k, v, do = _inputs(dtype)
    tables = torch.tensor(QR, dtype=torch.int32), torch.tensor(KR, dtype=torch.int32), torch.tensor(TYPES)
    checked = check_slices(*tables, q.shape[0], k.shape[0])
    kw = {"softcap": 2.0, "backend": backend}
    out, lse, mx = ffa_fwd(q, k, v, *tables, return_max_logits=True, **kw)
    got = ffa_fwd_checked(q, k, v, checked, return_max_logits=True, **kw)
    for a, b in zip(got, (out, lse, mx)):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    grads = ffa_bwd(do, q, k, v, out, lse, *tables, **kw)
    for a, b in zip(ffa_bwd_checked(do, q, k, v, out, lse, checked, **kw), grads):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_slices_are_checked_once_and_then_against_the_token_counts() -> None:
    q, k, v, _ = _inputs(torch.float64)
    with pytest.raises(ValueError, match="k_ranges"):
        check_slices(QR, [[0, 24], [8, 40], [30, 41]], TYPES, 48, 40)  # past total_k
    with pytest.raises(ValueError, match="attn_type_map"):
        check_slices(QR, KR, [1, 0], 48, 40)
    checked = check_slices(QR, KR, TYPES, 48, 40)
    with pytest.raises(ValueError, match="checked for 48 query and 40 key tokens"):
        ffa_fwd_checked(q, k[:30], v[:30], checked, backend="torch")
    with pytest.raises(ValueError, match="CheckedSlices"):
        ffa_fwd_checked(q, k, v, (QR, KR, TYPES), backend="torch")
