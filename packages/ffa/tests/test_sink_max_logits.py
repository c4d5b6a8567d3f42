"""Attention sinks, max logits and the lse gradient of magi_ffa, on the torch path (float64) and the Triton
kernels (under TRITON_INTERPRET=1 on CPU, fp32/fp16; on CUDA when there is one), against dense fp64.

The Triton forward merges the sinks in its epilogue and reports the row maxima it already keeps; these
tests check out, lse, dq, dk, dv, dsink and max_logits, the launchers' accumulate mode (sink merged by one
call, ``dlse`` / ``sink`` in ``ffa_bwd``), the max-only pass (``ffa_max_logits``) and torch.compile.
"""

from __future__ import annotations

import os

import pytest
import torch
from ffa_test_helpers import force_tiles

import magi_ffa
from magi_ffa import testing as T

CUDA = torch.cuda.is_available()
TRITON_OK = CUDA or os.environ.get("TRITON_INTERPRET") == "1"
DEV = "cuda" if CUDA else "cpu"
SMALL = "16,16,4,1"


def _dense(q, k, v, qr, kr, tm, sink, do, dlse, softcap=0.0):
    """fp64 dense truth of out, lse, max_logits and the gradients of loss = <out, do> + <lse, dlse>."""
    mask = T.make_attn_mask(qr, kr, tm, q.shape[0], k.shape[0])
    xs = [t.detach().double().cpu().requires_grad_() for t in (q, k, v, sink)]
    o, l = T.ref_attn(*xs[:3], mask, softcap=softcap, sink=xs[3])
    ((o * do.double().cpu()).sum() + (l * dlse.double().cpu()).sum()).backward()
    mx = T.ref_max_logits(xs[0].detach(), xs[1].detach(), mask, softcap=softcap)
    return dict(out=o.detach(), lse=l.detach(), max=mx, dq=xs[0].grad, dk=xs[1].grad, dv=xs[2].grad,
                dsink=xs[3].grad)  # fmt: skip


def _autograd(q, k, v, qr, kr, tm, sink, do, dlse, softcap=0.0):
    xs = [t.clone().requires_grad_() for t in (q, k, v, sink)]
    o, l, mx = magi_ffa.flex_flash_attn_func(
        *xs[:3], qr, kr, tm, softcap=softcap, sink=xs[3], return_max_logits=True
    )
    ((o.double() * do.double()).sum() + (l.double() * dlse.double()).sum()).backward()
    return dict(out=o, lse=l, max=mx, dq=xs[0].grad, dk=xs[1].grad, dv=xs[2].grad, dsink=xs[3].grad)


def _check(got: dict, ref: dict, tol: float, what: str) -> None:
    for name, r in ref.items():
        a = got[name].detach().double().cpu()
        assert a.shape == r.shape, f"{what}/{name}: shape {tuple(a.shape)} != {tuple(r.shape)}"
        assert not torch.isnan(a).any(), f"{what}/{name}: NaN"
        fin = torch.isfinite(r)
        assert torch.equal(torch.isfinite(a), fin), f"{what}/{name}: infinite entries differ"
        err = (
            ((a[fin] - r[fin]).abs().max() / r[fin].abs().max().clamp_min(1e-30)).item() if fin.any() else 0.0
        )
        lim = max(tol, 1e-6) if name in ("max", "dsink") else tol  # both are float32 by contract
        assert err < lim, f"{what}/{name}: rel err {err:.2e} >= {lim:.0e}"


def _case(dtype, tq=70, tk=90, hq=4, hk=2, d=16, seed=0, nsink=2, device="cpu"):
    qr, kr, tm = T.random_banded_slices(tq, tk, seed=seed)
    q, k, v = T.random_qkv(tq, tk, hq, hk, d, dtype, device, seed=seed)
    g = torch.Generator().manual_seed(seed + 100)
    sink = (torch.randn(nsink, hq, generator=g) * 2).to(device)
    do = torch.randn(q.shape, generator=g).to(device=device, dtype=dtype)
    dlse = torch.randn(tq, hq, generator=g).to(device)
    return q, k, v, qr, kr, tm, sink, do, dlse


def test_torch_path_fp64_matches_dense():
    for seed, softcap in ((9, 0.0), (11, 3.0), (4, 0.0)):
        args = _case(torch.float64, seed=seed, nsink=1 + seed % 3)
        mask = T.make_attn_mask(*args[3:6], 70, 90)
        assert (~mask.any(1)).any(), "the case must hold rows without keys"
        got = _autograd(*args, softcap=softcap)
        assert torch.isfinite(got["lse"]).all()
        _check(got, _dense(*args, softcap=softcap), 1e-12, f"torch/seed{seed}")


def test_sink_is_a_merge_and_max_matches_forward():
    """The sinks equal a log-sum-exp merge with a partial (out 0, lse logsumexp_t sink); no sinks, no max:
    the old 2-tuple."""
    q, k, v, qr, kr, tm, sink, *_ = _case(torch.float64)
    o0, l0 = magi_ffa.flex_flash_attn_func(q, k, v, qr, kr, tm)
    o1, l1 = magi_ffa.flex_flash_attn_func(q, k, v, qr, kr, tm, sink=sink)
    zero = torch.zeros_like(o0)
    ls = torch.logsumexp(sink.double(), 0).expand_as(l0)
    om, lm = magi_ffa.merge_out_lse(o0, l0, zero, ls)
    torch.testing.assert_close(o1, om)
    torch.testing.assert_close(l1, lm)
    om2, lm2 = magi_ffa.merge_sink(o0, l0, sink)
    torch.testing.assert_close(o1, om2)
    torch.testing.assert_close(l1, lm2)
    mx = magi_ffa.ffa_max_logits(q, k, qr, kr, tm)
    mask = T.make_attn_mask(qr, kr, tm, q.shape[0], k.shape[0])
    torch.testing.assert_close(mx.double(), T.ref_max_logits(q, k, mask), rtol=1e-6, atol=1e-6)


def test_launchers_accumulate_dlse_and_dsink_fp64():
    """Two accumulate-mode calls (the sink merged by the first), ffa_bwd with dlse, and dsink from the call
    given ``sink``: equal to the dense truth."""
    q, k, v, qr, kr, tm, sink, do, dlse = _case(torch.float64, seed=3)
    n = qr.shape[0]
    parts = (slice(0, n // 2), slice(n // 2, n))
    out = torch.empty_like(q)
    lse = torch.full(q.shape[:2], float("-inf"), dtype=torch.float64)
    maxes = []
    for i, p in enumerate(parts):
        kw = {"sink": sink} if i == 0 else {}
        _, _, m = magi_ffa.ffa_fwd(
            q, k, v, qr[p], kr[p], tm[p], out=out, lse=lse, return_max_logits=True, **kw
        )
        maxes.append(m)
    grads = [torch.zeros_like(t) for t in (q, k, v)]
    dsink = None
    for i, p in enumerate(parts):
        kw = {"sink": sink} if i == 0 else {}
        res = magi_ffa.ffa_bwd(
            do, q, k, v, out, lse, qr[p], kr[p], tm[p], dq=grads[0], dk=grads[1], dv=grads[2], dlse=dlse, **kw
        )
        if i == 0:
            assert len(res) == 4
            dsink = res[3]
        else:
            assert len(res) == 3
    got = dict(
        out=out, lse=lse, max=torch.maximum(*maxes), dq=grads[0], dk=grads[1], dv=grads[2], dsink=dsink
    )
    _check(got, _dense(q, k, v, qr, kr, tm, sink, do, dlse), 1e-7, "launchers")


triton_only = pytest.mark.skipif(not TRITON_OK, reason="needs CUDA or TRITON_INTERPRET=1")


@pytest.fixture
def triton_backend(monkeypatch):
    monkeypatch.setenv("MAGI_FFA_BACKEND", "triton")
    monkeypatch.setenv("MAGI_FFA_POISON", "1")


@triton_only
@pytest.mark.parametrize(
    ("dtype", "hq", "hk", "softcap", "tiles", "tol"),
    [
        pytest.param(torch.float32, 4, 2, 0.0, None, 2e-5, id="fp32-gqa2"),
        pytest.param(torch.float32, 2, 1, 2.5, SMALL, 2e-5, id="fp32-softcap-small-tiles"),
        pytest.param(torch.float16, 2, 2, 0.0, SMALL, 2e-2, id="fp16-small-tiles"),
    ],
)
def test_triton_sink_path_matches_dense(monkeypatch, triton_backend, dtype, hq, hk, softcap, tiles, tol):
    if tiles and not CUDA:
        force_tiles(monkeypatch, tiles)
    args = _case(dtype, hq=hq, hk=hk, seed=5, device=DEV)
    got = _autograd(*args, softcap=softcap)
    _check(got, _dense(*args, softcap=softcap), tol, f"triton/{dtype}")
    # the kernel's fused epilogue and the torch merge agree
    q, k, v, qr, kr, tm, sink = args[:7]
    o, l = magi_ffa.ffa_fwd(q, k, v, qr, kr, tm, softcap=softcap)
    om, lm = magi_ffa.merge_sink(o.float(), l, sink)
    o2, l2 = magi_ffa.ffa_fwd(q, k, v, qr, kr, tm, softcap=softcap, sink=sink)
    torch.testing.assert_close(o2.float(), om, rtol=tol, atol=tol)
    torch.testing.assert_close(l2, lm, rtol=1e-5, atol=1e-5)


@triton_only
def test_triton_accumulate_with_sink(triton_backend):
    q, k, v, qr, kr, tm, sink, do, dlse = _case(torch.float32, seed=7, device=DEV)
    n = qr.shape[0]
    out = torch.full(q.shape, float("nan"), device=DEV)
    lse = torch.full(q.shape[:2], float("-inf"), device=DEV)
    maxes = []
    for i, p in enumerate((slice(0, n // 2), slice(n // 2, n))):
        kw = {"sink": sink} if i == 1 else {}  # the sink may come with any one call
        maxes.append(
            magi_ffa.ffa_fwd(q, k, v, qr[p], kr[p], tm[p], out=out, lse=lse, return_max_logits=True, **kw)[2]
        )
    grads = [torch.zeros_like(t) for t in (q, k, v)]
    *_, dsink = magi_ffa.ffa_bwd(
        do, q, k, v, out, lse, qr, kr, tm, dq=grads[0], dk=grads[1], dv=grads[2], dlse=dlse, sink=sink
    )
    got = dict(
        out=out, lse=lse, max=torch.maximum(*maxes), dq=grads[0], dk=grads[1], dv=grads[2], dsink=dsink
    )
    _check(got, _dense(q, k, v, qr, kr, tm, sink, do, dlse), 2e-5, "triton-accumulate")


@triton_only
@pytest.mark.parametrize("d", [16, 24], ids=["d16", "d24-padded"])
def test_triton_max_only_pass(d):
    q, k, _, qr, kr, tm, *_ = _case(torch.float16, d=d, seed=9, device=DEV)
    mask = T.make_attn_mask(qr, kr, tm, q.shape[0], k.shape[0])
    ref = T.ref_max_logits(q.double().cpu(), k.double().cpu(), mask, softcap=4.0)
    mx = magi_ffa.ffa_max_logits(q, k, qr, kr, tm, softcap=4.0, backend="triton")
    assert mx.dtype == torch.float32 and mx.shape == (q.shape[1],)
    torch.testing.assert_close(mx.double().cpu(), ref, rtol=1e-5, atol=1e-5)
    # no visible pair at all: -inf
    none = magi_ffa.ffa_max_logits(q, k, [[0, 5]], [[3, 3]], None, backend="triton")
    assert torch.isneginf(none).all()


def test_bad_sink():
    q, k, v = T.random_qkv(8, 8, 2, 1, 16, torch.float32, seed=0)
    r = [[0, 8]]
    with pytest.raises(ValueError, match="sink"):
        magi_ffa.flex_flash_attn_func(q, k, v, r, r, sink=torch.zeros(1, 3))
    with pytest.raises(ValueError, match="sink"):
        magi_ffa.flex_flash_attn_func(q, k, v, r, r, sink=torch.zeros(1, 2, dtype=torch.float16))
    with pytest.raises(TypeError, match="sink"):
        magi_ffa.ffa_fwd(q, k, v, r, r, sink=[0.0, 0.0])


def test_compile_fullgraph_with_sink_and_max():
    q, k, v = T.random_qkv(32, 32, 2, 1, 16, torch.float32, seed=0)
    qr = torch.tensor([[0, 16], [16, 32]], dtype=torch.int32)
    tm = torch.tensor([1, 0], dtype=torch.int32)

    def f(q, k, v, sink):
        o, l, mx = magi_ffa.flex_flash_attn_func(q, k, v, qr, qr, tm, sink=sink, return_max_logits=True)
        return o.sum() + l.sum() + mx.sum().detach()

    xs = [t.clone().requires_grad_() for t in (q, k, v, torch.randn(2, 2))]
    g_eager = torch.autograd.grad(f(*xs), xs)
    cf = torch.compile(f, fullgraph=True, backend="aot_eager")
    g_comp = torch.autograd.grad(cf(*xs), xs)
    for a, b in zip(g_eager, g_comp):
        torch.testing.assert_close(a, b)
