"""Torch path (and the public API on it): fp64 exactness, low-precision rule, accumulate, autograd, errors."""

from __future__ import annotations

import pytest
import torch
from ffa_test_helpers import check_all, dense_refs

import magi_ffa
from magi_ffa import reference
from magi_ffa import testing as T

GQA = [pytest.param(2, 2, id="mha"), pytest.param(4, 2, id="gqa2"), pytest.param(8, 1, id="mqa8")]


@pytest.fixture(autouse=True)
def _torch_backend(monkeypatch):
    monkeypatch.setenv("MAGI_FFA_BACKEND", "torch")


@pytest.mark.parametrize("hq,hk", GQA)
@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("softcap", [0.0, 2.5])
def test_fp64_exact_fwd_bwd(hq, hk, seed, softcap):
    tq, tk = 37 + 29 * seed, 300 - 31 * seed
    qr, kr, tm = T.random_banded_slices(tq, tk, seed=seed)
    q, k, v = T.random_qkv(tq, tk, hq, hk, 16, torch.float64, seed=seed)
    do = torch.randn_like(q)
    o, l = magi_ffa.ffa_fwd(q, k, v, qr, kr, tm, softcap=softcap)
    dq, dk, dv = magi_ffa.ffa_bwd(do, q, k, v, o, l, qr, kr, tm, softcap=softcap)
    r64, _ = dense_refs(q, k, v, qr, kr, tm, softcap=softcap, do=do)
    check_all(dict(out=o, lse=l, dq=dq, dk=dk, dv=dv), r64, r64, torch.float64)


def test_blocks_larger_than_block_size(monkeypatch):
    """Several q and k blocks per slice (the block loops and boundary masks of the torch path)."""
    monkeypatch.setattr(reference, "BLOCK_Q", 16)
    monkeypatch.setattr(reference, "BLOCK_K", 24)
    tq, tk = 150, 170
    qr = [[0, 150], [10, 90], [90, 150], [0, 60]]
    kr = [[0, 60], [60, 170], [60, 170], [60, 100]]
    tm = [1, 2, 3, 0]
    q, k, v = T.random_qkv(tq, tk, 4, 2, 8, torch.float64, seed=3)
    do = torch.randn_like(q)
    # First slices 1 and 3 share pairs (the mask is their union), then all areas are disjoint.
    for q3 in ([0, 60], [0, 10]):
        qr[3] = q3
        o, l = magi_ffa.ffa_fwd(q, k, v, qr, kr, tm)
        grads = magi_ffa.ffa_bwd(do, q, k, v, o, l, qr, kr, tm)
        r64, _ = dense_refs(q, k, v, qr, kr, tm, do=do)
        check_all(dict(out=o, lse=l, dq=grads[0], dk=grads[1], dv=grads[2]), r64, r64, torch.float64)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
def test_low_precision_rule_autograd(dtype):
    tq, tk = 120, 140
    qr, kr, tm = T.random_banded_slices(tq, tk, seed=11)
    q, k, v = T.random_qkv(tq, tk, 4, 2, 32, dtype, seed=2)
    do = torch.randn(q.shape, dtype=torch.float64).to(dtype)
    dlse = torch.randn(tq, 4, dtype=torch.float64)
    xs = [t.clone().requires_grad_() for t in (q, k, v)]
    o, l = magi_ffa.flex_flash_attn_func(*xs, qr, kr, tm)
    assert o.dtype == dtype and l.dtype == torch.float32
    loss = (o.float() * do.float()).sum() + (torch.where(torch.isneginf(l), 0, l) * dlse.float()).sum()
    dq, dk, dv = torch.autograd.grad(loss, xs)
    r64, rlp = dense_refs(q, k, v, qr, kr, tm, do=do, dlse=dlse)
    check_all(dict(out=o, lse=l, dq=dq, dk=dk, dv=dv), r64, rlp, dtype)


@pytest.mark.parametrize("out_fp32", [True, False], ids=["out_fp32", "out_dtype"])
def test_accumulate_two_stages(out_fp32):
    """Slices split over two calls, merged through out/lse; backward per stage with final out/lse."""
    tq, tk = 96, 128
    qr, kr, tm = T.random_banded_slices(tq, tk, seed=5, max_bands=5)
    n = qr.shape[0]
    a, b = slice(0, n // 2), slice(n // 2, n)
    q, k, v = T.random_qkv(tq, tk, 4, 4, 16, torch.bfloat16, seed=7)
    out = torch.full(q.shape, float("nan"), dtype=torch.float32 if out_fp32 else q.dtype)
    lse = torch.full((tq, 4), float("-inf"))  # -inf rows ignore the (NaN) content of out
    magi_ffa.ffa_fwd(q, k, v, qr[a], kr[a], tm[a], out=out, lse=lse)
    o, l = magi_ffa.ffa_fwd(q, k, v, qr[b], kr[b], tm[b], out=out, lse=lse)
    assert o is out and l is lse
    do = torch.randn(q.shape).to(q.dtype)
    dq, dk, dv = (torch.zeros(t.shape) for t in (q, k, v))
    for part in (a, b):
        magi_ffa.ffa_bwd(do, q, k, v, out, lse, qr[part], kr[part], tm[part], dq=dq, dk=dk, dv=dv)
    r64, rlp = dense_refs(q, k, v, qr, kr, tm, do=do)
    check_all(dict(out=out, lse=lse, dq=dq, dk=dk, dv=dv), r64, rlp, torch.bfloat16)


def test_accumulate_autograd_flex():
    tq, tk = 64, 64
    q, k, v = T.random_qkv(tq, tk, 2, 2, 16, torch.float64, seed=1)
    xs = [t.clone().requires_grad_() for t in (q, k, v)]
    out = torch.zeros(q.shape, dtype=torch.float64)
    lse = torch.full((tq, 2), float("-inf"), dtype=torch.float64)
    magi_ffa.flex_flash_attn_func(*xs, [[0, 64]], [[0, 32]], [1], out=out, lse=lse)
    o, l = magi_ffa.flex_flash_attn_func(*xs, [[0, 64]], [[32, 64]], [1], out=out, lse=lse)
    do = torch.randn_like(q)
    grads = torch.autograd.grad((o * do).sum(), xs)
    r64, _ = dense_refs(q, k, v, [[0, 64], [0, 64]], [[0, 32], [32, 64]], [1, 1], do=do)
    check_all(dict(out=o, lse=l, dq=grads[0], dk=grads[1], dv=grads[2]), r64, r64, torch.float64)


def test_no_slices_and_empty_slices():
    q, k, v = T.random_qkv(8, 5, 2, 1, 16, torch.float32, seed=0)
    for qr, kr, tm in (
        ([], [], None),
        ([[3, 3], [0, 8]], [[0, 5], [2, 2]], [0, 1]),
        ([[0, 8]], [[0, 5]], [3]),
    ):
        o, l = magi_ffa.ffa_fwd(q, k, v, qr, kr, tm)
        assert torch.equal(o, torch.zeros_like(o)) and torch.isneginf(l).all()
        do = torch.randn_like(q)
        for g in magi_ffa.ffa_bwd(do, q, k, v, o, l, qr, kr, tm):
            assert torch.equal(g, torch.zeros_like(g))


def test_non_contiguous_and_deterministic():
    q, k, v = T.random_qkv(64, 48, 4, 2, 16, torch.float32, seed=4)
    qn = q.transpose(0, 1).contiguous().transpose(0, 1)  # same values, head-major strides
    vn = torch.cat([v, v], dim=-1)[..., :16]  # last-dim view of a wider tensor
    qr, kr, tm = T.random_banded_slices(64, 48, seed=9)
    o1, l1 = magi_ffa.ffa_fwd(q, k, v, qr, kr, tm)
    o2, l2 = magi_ffa.ffa_fwd(qn, k, vn, qr, kr, tm)
    assert torch.equal(o1, o2) and torch.equal(l1, l2)
    do = torch.randn_like(q)
    g1 = magi_ffa.ffa_bwd(do, q, k, v, o1, l1, qr, kr, tm, deterministic=True)
    g2 = magi_ffa.ffa_bwd(do, qn, k, vn, o1, l1, qr, kr, tm, deterministic=True)
    assert all(torch.equal(a, b) for a, b in zip(g1, g2))


def test_compile_fullgraph():
    q, k, v = T.random_qkv(32, 32, 2, 1, 16, torch.float32, seed=0)
    qr = torch.tensor([[0, 16], [16, 32]], dtype=torch.int32)
    tm = torch.tensor([1, 0], dtype=torch.int32)

    def f(q, k, v):
        o, l = magi_ffa.flex_flash_attn_func(q, k, v, qr, qr, tm, softcap=3.0)
        return o.sum() + l.sum()

    xs = [t.clone().requires_grad_() for t in (q, k, v)]
    g_eager = torch.autograd.grad(f(*xs), xs)
    cf = torch.compile(f, fullgraph=True, backend="aot_eager")
    g_comp = torch.autograd.grad(cf(*xs), xs)
    for a, b in zip(g_eager, g_comp):
        torch.testing.assert_close(a, b)


def _bad(match, *args, **kw):
    with pytest.raises(ValueError, match=match):
        magi_ffa.flex_flash_attn_func(*args, **kw)
        magi_ffa.ffa_fwd(*args, **kw)


def test_bad_input():
    q, k, v = T.random_qkv(16, 12, 4, 2, 16, torch.float32, seed=0)
    r = [[0, 8]]
    _bad("num_heads_q", q, k[:, :1].expand(12, 3, 16), v[:, :1].expand(12, 3, 16), r, r)
    _bad("q_ranges", q, k, v, [[0, 17]], r)
    _bad("k_ranges", q, k, v, r, [[0, 13]])
    _bad("q_ranges", q, k, v, [[5, 4]], r)
    _bad("dtype", q, k.double(), v, r, r)
    _bad("dtype", q.int(), k, v, r, r)
    _bad("attn_type_map", q, k, v, r, r, [4])
    _bad("attn_type_map", q, k, v, r, r, [0, 1])
    _bad("same number", q, k, v, [[0, 8], [8, 16]], r)
    _bad("q_ranges", q, k, v, torch.tensor([[0.0, 8.0]]), r)
    _bad("k_ranges", q, k, v, r, [[0, 4, 5]])
    _bad("3-D", q[0], k, v, r, r)
    _bad("head_dim", q, k[..., :8], v[..., :8], r, r)
    _bad("softcap", q, k, v, r, r, softcap=-1.0)
    _bad("softmax_scale", q, k, v, r, r, softmax_scale=0.0)
    _bad("lse", q, k, v, r, r, out=torch.zeros_like(q), lse=None)
    _bad("lse", q, k, v, r, r, out=torch.zeros_like(q), lse=torch.zeros(16, 4, dtype=torch.float64))
    with pytest.raises(TypeError, match="`q`"):
        magi_ffa.ffa_fwd(None, k, v, r, r)


def test_backend_env(monkeypatch):
    q, k, v = T.random_qkv(16, 16, 2, 2, 16, torch.float32, seed=0)
    monkeypatch.setenv("MAGI_FFA_BACKEND", "cuda")
    with pytest.raises(ValueError, match="MAGI_FFA_BACKEND"):
        magi_ffa.ffa_fwd(q, k, v, [[0, 16]], [[0, 16]])
    monkeypatch.setenv("MAGI_FFA_BACKEND", "triton")
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(ValueError, match="CUDA"):
        magi_ffa.ffa_fwd(q, k, v, [[0, 16]], [[0, 16]])
    with pytest.raises(ValueError, match="float64"):
        magi_ffa.ffa_fwd(q.double(), k.double(), v.double(), [[0, 16]], [[0, 16]])


def test_testing_helpers():
    m = T.make_attn_mask([[0, 3]] * 4, [[0, 4]] * 4, [0, 1, 2, 3], 3, 4)
    assert m.tolist() == [[True] * 4] * 3
    expect = {1: [[1, 1, 0, 0], [1, 1, 1, 0], [1, 1, 1, 1]], 2: [[1, 1, 1, 1], [0, 1, 1, 1], [0, 0, 1, 1]],
              3: [[1, 1, 0, 0], [0, 1, 1, 0], [0, 0, 1, 1]]}  # fmt: skip
    for t, mat in expect.items():
        assert T.make_attn_mask([[0, 3]], [[0, 4]], [t], 3, 4).int().tolist() == mat
    assert T.make_attn_mask([[0, 4]], [[0, 3]], [1], 4, 3).int().tolist()[0] == [0, 0, 0]
    a, b = T.random_banded_slices(50, 60, seed=1), T.random_banded_slices(50, 60, seed=1)
    assert all(torch.equal(x, y) for x, y in zip(a, b))
    ref = torch.randn(100, dtype=torch.float64)
    with pytest.raises(AssertionError, match="out"):
        T.assert_close_to_ref("out", ref + 0.1, ref, ref + 1e-3, torch.bfloat16)
