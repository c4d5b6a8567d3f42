"""The fused log-sum-exp merge against an fp64 formula (Triton interpreter on the CPU, the GPU when present)."""

from __future__ import annotations

import zlib

import pytest
import torch

from magi_ffa_fa4 import merge_out_lse_

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _reference(out_a, lse_a, out_b, lse_b):
    la, lb = lse_a.double(), lse_b.double()
    lse = torch.logaddexp(la, lb)
    safe = torch.where(torch.isneginf(lse), 0.0, lse)
    wa = torch.where(torch.isneginf(la), 0.0, torch.exp(la - safe))[..., None]
    wb = torch.where(torch.isneginf(lb), 0.0, torch.exp(lb - safe))[..., None]
    a = torch.where(wa > 0, out_a.double(), 0.0)
    b = torch.where(wb > 0, out_b.double(), 0.0)
    return a * wa + b * wb, lse


@pytest.mark.parametrize("acc_dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("shape", [(37, 3, 16), (8, 2, 24)])
def test_merge_matches_fp64(acc_dtype, shape) -> None:
    gen = torch.Generator().manual_seed(zlib.crc32(f"{acc_dtype}{shape}".encode()))
    t, h, _ = shape
    out_a = torch.randn(shape, generator=gen).to(acc_dtype)
    out_b = torch.randn(shape, generator=gen).to(torch.float16)
    lse_a = torch.randn(t, h, generator=gen) * 3
    # the new lse arrives as a transposed view of a [h, t] tensor, as FA4 returns it
    lse_b = (torch.randn(h, t, generator=gen) * 3).t()
    lse_a[::5] = float("-inf")
    out_a[::5] = float("nan")  # rows without keys may hold garbage: it must not leak
    lse_b[1::7] = float("-inf")
    lse_b[::35] = float("-inf")  # some rows empty in both
    want_out, want_lse = _reference(out_a, lse_a, out_b, lse_b)
    acc, acc_lse = out_a.to(DEVICE), lse_a.to(DEVICE)
    got, got_lse = merge_out_lse_(acc, acc_lse, out_b.to(DEVICE), lse_b.to(DEVICE))
    assert got is acc and got_lse is acc_lse  # in place
    assert not torch.isnan(got).any()
    tol = 1e-6 if acc_dtype == torch.float32 else 2e-3
    torch.testing.assert_close(got.double().cpu(), want_out, rtol=tol, atol=tol)
    both_empty = torch.isneginf(want_lse)
    assert torch.isneginf(got_lse.cpu()[both_empty]).all()
    assert (got.cpu()[both_empty] == 0).all()
    torch.testing.assert_close(
        got_lse.double().cpu()[~both_empty], want_lse[~both_empty], rtol=1e-6, atol=1e-6
    )


def test_merge_rejects_bad_shapes() -> None:
    out = torch.zeros(4, 2, 8)
    lse = torch.zeros(4, 2)
    with pytest.raises(ValueError, match="shapes"):
        merge_out_lse_(out, lse, torch.zeros(4, 2, 16), lse.clone())
    with pytest.raises(ValueError, match="float32"):
        merge_out_lse_(out, lse, out.clone(), lse.double())
