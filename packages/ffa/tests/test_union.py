"""The mask is the union of the slices, also when slices share (query, key) pairs: each pair counts once."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch
from magi_mask import region_dense

from magi_ffa import flex_flash_attn_func
from magi_ffa._disjoint import disjoint_slices
from magi_ffa._slice import make_slice
from magi_ffa.testing import make_attn_mask, ref_attn


def _shared_pair_slices(rng: random.Random, total: int, n: int):
    """Unconstrained random slices of all four types: most masks have slices sharing pairs."""
    q_ranges, k_ranges, types = [], [], []
    for _ in range(n):
        a = rng.randrange(0, total)
        c = rng.randrange(0, total)
        q_ranges.append([a, rng.randrange(a, total + 1)])
        k_ranges.append([c, rng.randrange(c, total + 1)])
        types.append(rng.randrange(4))
    return q_ranges, k_ranges, types


def _dense(slices, total):
    """Cover counts of kernel slices: each is the band region rows x keys x its diagonal offsets."""
    m = np.zeros((total, total), dtype=np.int64)
    for s in slices:
        lo = s.dk_inv if s.is_inv_causal else -total
        hi = s.dk if s.is_causal else total
        m += region_dense((s.q_start, s.q_end, s.k_start, s.k_end, lo, hi), total, total)
    return torch.from_numpy(m)


@pytest.mark.parametrize("seed", range(40))
def test_rewrite_is_disjoint_and_covers_the_union(seed: int) -> None:
    rng = random.Random(seed)
    total = rng.randrange(4, 40)
    q_ranges, k_ranges, types = _shared_pair_slices(rng, total, rng.randrange(2, 8))
    raw = tuple(s for s in (make_slice(*q, *k, t) for q, k, t in zip(q_ranges, k_ranges, types)) if s)
    counts = _dense(disjoint_slices(raw), total)
    union = make_attn_mask(q_ranges, k_ranges, types, total, total)
    assert counts.max() <= 1, "a pair is covered twice after the rewrite"
    assert torch.equal(counts.bool(), union), "the rewrite changed the union"


def test_disjoint_slices_pass_through_unchanged() -> None:
    raw = tuple(make_slice(*s) for s in ((0, 8, 0, 8, 1), (8, 16, 0, 16, 1), (0, 16, 16, 20, 0)))
    assert disjoint_slices(raw) is raw


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_union_matches_dense_reference(monkeypatch, backend: str) -> None:
    monkeypatch.setenv("MAGI_FFA_BACKEND", backend)
    dtype = torch.float64 if backend == "torch" else torch.float32
    # the Triton kernels run on the GPU when there is one, else under the interpreter on CPU tensors
    dev = "cuda" if backend == "triton" and torch.cuda.is_available() else "cpu"
    for seed in range(12 if backend == "torch" else 3):
        rng = random.Random(100 + seed)
        total = 48
        q_ranges, k_ranges, types = _shared_pair_slices(rng, total, 5)
        gen = torch.Generator().manual_seed(seed)
        q, k, v = (
            torch.randn(total, h, 16, dtype=dtype, generator=gen).to(dev).requires_grad_() for h in (2, 1, 1)
        )
        out, lse = flex_flash_attn_func(q, k, v, q_ranges, k_ranges, types)
        do = torch.randn(out.shape, dtype=dtype, generator=gen).to(dev)
        grads = torch.autograd.grad((out * do).sum(), (q, k, v))
        out, lse, do, grads = out.cpu(), lse.cpu(), do.cpu(), [g.cpu() for g in grads]
        q64, k64, v64 = (t.detach().cpu().double().requires_grad_() for t in (q, k, v))
        out_ref, lse_ref = ref_attn(q64, k64, v64, make_attn_mask(q_ranges, k_ranges, types, total, total))
        ref_grads = torch.autograd.grad((out_ref * do.double()).sum(), (q64, k64, v64))
        tol = 1e-10 if dtype == torch.float64 else 2e-4
        for name, got, ref in zip(("out", "dq", "dk", "dv"), (out, *grads), (out_ref, *ref_grads)):
            err = ((got.double() - ref).norm() / ref.norm().clamp_min(1e-30)).item()
            assert err < tol, f"seed {seed} {name}: rel err {err:.2e}"
        assert torch.equal(torch.isinf(lse), torch.isinf(lse_ref))
