"""The Triton kernels (fwd, dq, dkv): under TRITON_INTERPRET=1 on CPU tensors, or on a CUDA GPU.

Same checks as the torch path: random slices of all four types with q/k overlaps, empty slices and rows
without keys, GQA, softcap, accumulate mode, determinism, non-contiguous inputs, poisoned outputs.
"""

from __future__ import annotations

import os

import pytest
import torch
from ffa_test_helpers import check_all, dense_refs, force_tiles

import magi_ffa
from magi_ffa import testing as T

CUDA = torch.cuda.is_available()
pytestmark = pytest.mark.skipif(
    not CUDA and os.environ.get("TRITON_INTERPRET") != "1", reason="needs CUDA or TRITON_INTERPRET=1"
)
DEV = "cuda" if CUDA else "cpu"
SCALE = 8 if CUDA else 1  # the interpreter runs ~10 ms per tile step: tiny shapes on CPU
DTYPES = [torch.float16, torch.bfloat16] + ([] if CUDA else [torch.float32])
# small tiles on CPU put several q/k blocks into every slice (boundary and interior tiles both run)
SMALL = "16,16,4,1"


@pytest.fixture(autouse=True)
def _triton_backend(monkeypatch):
    monkeypatch.setenv("MAGI_FFA_BACKEND", "triton")
    monkeypatch.setenv("MAGI_FFA_POISON", "1")


def _run(q, k, v, qr, kr, tm, do, softcap=0.0, dlse=None):
    o, l = magi_ffa.ffa_fwd(q, k, v, qr, kr, tm, softcap=softcap)
    out = o
    if dlse is None:
        dq, dk, dv = magi_ffa.ffa_bwd(do, q, k, v, o, l, qr, kr, tm, softcap=softcap)
    else:  # lse gradient through the autograd entry
        xs = [t.clone().requires_grad_() for t in (q, k, v)]
        out, l = magi_ffa.flex_flash_attn_func(*xs, qr, kr, tm, softcap=softcap)
        loss = (out.float() * do.float()).sum() + (torch.where(torch.isneginf(l), 0, l) * dlse).sum()
        dq, dk, dv = torch.autograd.grad(loss, xs)
    return dict(out=out, lse=l, dq=dq, dk=dk, dv=dv)


CASES = [
    pytest.param(torch.bfloat16, 4, 2, 64, 0, 0.0, None, id="bf16-gqa2-d64"),
    pytest.param(torch.float16, 2, 2, 32, 1, 0.0, None, id="fp16-mha-d32"),
    pytest.param(torch.float16, 8, 1, 16, 2, 3.0, None, id="fp16-mqa8-d16-softcap"),
    pytest.param(torch.bfloat16, 2, 1, 32, 3, 0.0, SMALL, id="bf16-gqa2-small-tiles"),
    pytest.param(torch.float16, 4, 4, 16, 4, 2.0, SMALL, id="fp16-mha-small-tiles-softcap"),
    pytest.param(torch.float16, 2, 2, 64, 5, 0.0, "32,16,4,1", id="fp16-d64-tiles32x16"),
]


@pytest.mark.parametrize("dtype,hq,hk,d,seed,softcap,tiles", CASES)
def test_random_slices(monkeypatch, dtype, hq, hk, d, seed, softcap, tiles):
    if tiles and not CUDA:
        force_tiles(monkeypatch, tiles)
    tq, tk = (90 + 23 * seed) * SCALE, (140 - 11 * seed) * SCALE
    qr, kr, tm = T.random_banded_slices(tq, tk, seed=seed, max_bands=4 if SCALE == 1 else 8)
    q, k, v = T.random_qkv(tq, tk, hq, hk, d, dtype, DEV, seed=seed)
    do = torch.randn(q.shape, device=DEV).to(dtype)
    got = _run(q, k, v, qr.to(DEV), kr.to(DEV), tm.to(DEV), do, softcap)
    r64, rlp = dense_refs(q, k, v, qr, kr, tm, softcap=softcap, do=do)
    check_all(got, r64, rlp, dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_masks_by_type_and_lse_grad(monkeypatch, dtype):
    """Each type alone (aligned and unaligned sizes, sq > sk and sq < sk) plus the lse gradient; small tiles
    on CPU, so every slice has interior (unmasked) and boundary tiles."""
    if not CUDA:
        force_tiles(monkeypatch, SMALL)
    s = SCALE
    qr = [[0, 40 * s], [40 * s, 70 * s], [70 * s, 100 * s], [100 * s, 120 * s], [0, 40 * s]]
    kr = [[0, 64 * s], [30 * s, 50 * s], [50 * s, 100 * s], [100 * s, 128 * s], [64 * s, 90 * s]]
    tm = [1, 1, 2, 3, 2]
    q, k, v = T.random_qkv(128 * s, 128 * s, 2, 1, 32, dtype, DEV, seed=1)
    do = torch.randn(q.shape, device=DEV).to(dtype)
    dlse = torch.randn(q.shape[:2], device=DEV)
    got = _run(q, k, v, qr, kr, tm, do, dlse=dlse)
    r64, rlp = dense_refs(q, k, v, qr, kr, tm, do=do, dlse=dlse)
    check_all(got, r64, rlp, dtype)


@pytest.mark.parametrize("out_fp32", [True, False], ids=["out_fp32", "out_dtype"])
def test_accumulate_two_stages(out_fp32):
    tq, tk = 96 * SCALE, 128 * SCALE
    qr, kr, tm = T.random_banded_slices(tq, tk, seed=21, max_bands=5)
    n = qr.shape[0]
    parts = (slice(0, n // 2), slice(n // 2, n))
    q, k, v = T.random_qkv(tq, tk, 4, 2, 32, torch.bfloat16, DEV, seed=7)
    out = torch.full(q.shape, float("nan"), dtype=torch.float32 if out_fp32 else q.dtype, device=DEV)
    lse = torch.full((tq, 4), float("-inf"), device=DEV)
    for p in parts:
        magi_ffa.ffa_fwd(q, k, v, qr[p], kr[p], tm[p], out=out, lse=lse)
    do = torch.randn(q.shape, device=DEV).to(q.dtype)
    grads = [torch.zeros(t.shape, device=DEV) for t in (q, k, v)]
    for p in parts:
        magi_ffa.ffa_bwd(do, q, k, v, out, lse, qr[p], kr[p], tm[p], dq=grads[0], dk=grads[1], dv=grads[2])
    r64, rlp = dense_refs(q, k, v, qr, kr, tm, do=do)
    check_all(dict(out=out, lse=lse, dq=grads[0], dk=grads[1], dv=grads[2]), r64, rlp, torch.bfloat16)


def test_deterministic_noncontiguous_and_empty():
    tq = 64 * SCALE
    q, k, v = T.random_qkv(tq, tq, 4, 2, 32, torch.float16, DEV, seed=3)
    qr, kr, tm = T.random_banded_slices(tq, tq, seed=8)
    do = torch.randn(q.shape, device=DEV).to(q.dtype)
    a = _run(q, k, v, qr, kr, tm, do)
    qn = q.transpose(0, 1).contiguous().transpose(0, 1)
    vn = torch.cat([v, v], dim=-1)[..., :32]
    b = _run(qn, k, vn, qr, kr, tm, do)
    for name in a:
        assert torch.equal(a[name], b[name]), f"{name} not bitwise reproducible"
    o, l = magi_ffa.ffa_fwd(q, k, v, [], [], None)
    assert torch.equal(o, torch.zeros_like(o)) and torch.isneginf(l).all()
    for g in magi_ffa.ffa_bwd(do, q, k, v, o, l, [], [], None):
        assert torch.equal(g, torch.zeros_like(g))


@pytest.mark.parametrize("head_major", [True, False], ids=["head_major", "heads_fastest"])
def test_split_backward_matches_one_launch(monkeypatch, head_major):
    """The backward as two launches (K/V programs, then q programs) against dense fp64, and (under the
    interpreter, where both run the same operations in the same order) bitwise equal to the one launch."""
    tq, tk = 130 * SCALE, 110 * SCALE
    qr, kr, tm = T.random_banded_slices(tq, tk, seed=11, max_bands=4 if SCALE == 1 else 8)
    q, k, v = T.random_qkv(tq, tk, 4, 2, 32, torch.float16, DEV, seed=11)
    do = torch.randn(q.shape, device=DEV).to(torch.float16)
    got = {}
    for split in (False, True):
        monkeypatch.setenv("MAGI_FFA_TILES_FWD", "16,16,4,1")
        monkeypatch.setenv("MAGI_FFA_TILES_BWD", f"16,16,16,16,4,1,{int(head_major)},{int(split)}")
        got[split] = _run(q, k, v, qr.to(DEV), kr.to(DEV), tm.to(DEV), do)
    r64, rlp = dense_refs(q, k, v, qr, kr, tm, do=do)
    check_all(got[True], r64, rlp, torch.float16)
    if not CUDA:
        for name in ("dq", "dk", "dv"):
            assert torch.equal(got[True][name], got[False][name]), name


GPU_CASES = [
    pytest.param(torch.bfloat16, 8, 2, 128, id="bf16-gqa4-d128"),
    pytest.param(torch.bfloat16, 4, 4, 256, id="bf16-mha-d256"),
    pytest.param(torch.float16, 8, 1, 64, id="fp16-mqa-d64"),
    pytest.param(torch.float32, 4, 2, 128, id="fp32-gqa2-d128"),
]


@pytest.mark.skipif(not CUDA, reason="realistic sizes and the tile table's rows need a GPU")
@pytest.mark.parametrize("dtype,hq,hk,d", GPU_CASES)
def test_gpu_table_tiles_dense_and_bitwise_repeatable(dtype, hq, hk, d):
    """The shipped tiles of every head_dim against dense fp64, then bitwise-identical out, lse and gradients
    over repeated runs at a size where thousands of programs run concurrently (a race would show here; the
    interpreter runs programs one at a time, so it cannot)."""
    tq, tk = 3000, 2600
    qr, kr, tm = T.random_banded_slices(tq, tk, seed=d + hq, max_bands=12)
    q, k, v = T.random_qkv(tq, tk, hq, hk, d, dtype, DEV, seed=d)
    do = torch.randn(q.shape, device=DEV).to(dtype)
    first = _run(q, k, v, qr, kr, tm, do)
    r64, rlp = dense_refs(q, k, v, qr, kr, tm, do=do)
    check_all(first, r64, rlp, dtype)
    big = 24576
    qr, kr, tm = T.random_banded_slices(big, big, seed=5, max_bands=40)
    q, k, v = T.random_qkv(big, big, hq, hk, d, dtype, DEV, seed=6)
    do = torch.randn(q.shape, device=DEV).to(dtype)
    ref = _run(q, k, v, qr, kr, tm, do)
    for _ in range(3):
        again = _run(q, k, v, qr, kr, tm, do)
        for name in ref:
            assert torch.equal(ref[name], again[name]), f"{name} differs between identical runs"


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_forward_tma_equals_pointer_loads(monkeypatch, dtype):
    """The forward's full tiles through tensor descriptors (TMA) give bitwise the pointer path's result."""
    tq, tk = 150 * SCALE, 170 * SCALE
    qr, kr, tm = T.random_banded_slices(tq, tk, seed=31, max_bands=5)
    q, k, v = T.random_qkv(tq, tk, 4, 2, 32, dtype, DEV, seed=9)
    bm, bn, rest = ("16", "16", "4,1") if not CUDA else ("128", "64", "4,3")
    results = []
    for tma in (0, 1):
        monkeypatch.setenv("MAGI_FFA_TILES_FWD", f"{bm},{bn},{rest},{tma}")
        results.append(magi_ffa.ffa_fwd(q, k, v, qr, kr, tm))
    assert torch.equal(results[0][0], results[1][0]) and torch.equal(results[0][1], results[1][1])
    r64, rlp = dense_refs(q, k, v, qr, kr, tm)
    check_all(dict(out=results[1][0], lse=results[1][1]), r64, rlp, dtype)
