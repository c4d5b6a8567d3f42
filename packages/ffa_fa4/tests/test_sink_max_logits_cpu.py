"""The FA4 backend's sink, max-logits and dlse plumbing on the CPU, with FlashAttention-4 replaced by a fake.

flash-attn-4 does not run here: the fake ``_flash_attn_fwd`` / ``_flash_attn_bwd`` compute with magi_ffa's
torch path for the mask under test (same layouts, same ``dlse`` semantics as FA4), so these tests check what
magi_ffa_fa4 itself adds around the kernels: the sink merge (autograd and launchers), ``dlse`` passed to
the backward, ``dsink``, and the separate max pass (magi_ffa's Triton kernel under the interpreter). The real
kernels are covered by tests/test_fa4_gpu.py on a GPU.
"""

from __future__ import annotations

import os
from types import SimpleNamespace

import pytest
import torch

import magi_ffa
import magi_ffa_fa4
from magi_ffa import testing as T
from magi_ffa_fa4 import interface

pytestmark = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="needs TRITON_INTERPRET=1")

TQ, TK, HQ, HK, D = 48, 56, 2, 1, 16


@pytest.fixture
def fake_fa4(monkeypatch):
    qr, kr, tm = T.random_banded_slices(TQ, TK, seed=4)

    def fwd(q4, k4, v4, softmax_scale, softcap, return_lse, out=None, lse=None, **_):
        assert return_lse
        o, l = magi_ffa.reference.ffa_fwd(
            q4[0], k4[0], v4[0], qr, kr, tm, softmax_scale=softmax_scale, softcap=softcap
        )
        return o[None], l.t()[None].contiguous().float()

    def bwd(
        q4, k4, v4, out4, do4, lse3, softmax_scale, *args, softcap=0.0, dlse=None, deterministic=False, **_
    ):
        if args:  # the autograd path passes (causal, softcap) positionally
            softcap = args[1]
        grads = magi_ffa.reference.ffa_bwd(
            do4[0], q4[0], k4[0], v4[0], out4[0], lse3[0].t().contiguous(), qr, kr, tm,
            softmax_scale=softmax_scale, softcap=softcap, dlse=None if dlse is None else dlse[0].t(),
        )  # fmt: skip
        return tuple(g[None] for g in grads)

    meta = SimpleNamespace(
        has_empty_rows=False, mask_mod=None, fwd_bst=None, bwd_bst=None, bounds=None, varlen=None
    )
    monkeypatch.setattr(interface, "_fa4", lambda: SimpleNamespace(_flash_attn_fwd=fwd, _flash_attn_bwd=bwd))
    monkeypatch.setattr(interface, "get_launch_meta", lambda *a, **k: meta)
    # the contract's checks with FA4's dtypes and head dims, on the CPU and without an architecture
    relaxed = interface.relaxed_capability(architectures="any", device="any")
    monkeypatch.setattr(interface.BACKEND, "capability", relaxed)
    return qr, kr, tm


def _inputs():
    q, k, v = T.random_qkv(TQ, TK, HQ, HK, D, torch.float16, seed=2)
    g = torch.Generator().manual_seed(3)
    return (
        q,
        k,
        v,
        torch.randn(2, HQ, generator=g),
        torch.randn(q.shape, generator=g).half(),
        torch.randn(TQ, HQ),
    )


def _dense(q, k, v, qr, kr, tm, sink, do, dlse, softcap):
    mask = T.make_attn_mask(qr, kr, tm, TQ, TK)
    xs = [t.double().requires_grad_() for t in (q, k, v, sink)]
    o, l = T.ref_attn(*xs[:3], mask, softcap=softcap, sink=xs[3])
    ((o * do.double()).sum() + (l * dlse.double()).sum()).backward()
    mx = T.ref_max_logits(xs[0].detach(), xs[1].detach(), mask, softcap=softcap)
    return [o.detach(), l.detach(), mx, *(x.grad for x in xs)]


def _close(got, ref, what):
    names = ["out", "lse", "max", "dq", "dk", "dv", "dsink"]
    for name, a, r in zip(names, got, ref):
        err = ((a.double() - r).abs().max() / r.abs().max()).item()
        assert err < 2e-2, f"{what}/{name}: rel err {err:.2e}"


@pytest.mark.parametrize("softcap", [0.0, 3.0])
def test_autograd_entry_with_sink_and_max(fake_fa4, softcap):
    qr, kr, tm = fake_fa4
    q, k, v, sink, do, dlse = _inputs()
    xs = [t.clone().requires_grad_() for t in (q, k, v, sink)]
    o, l, mx = magi_ffa_fa4.flex_flash_attn_func(
        *xs[:3], qr, kr, tm, softcap=softcap, sink=xs[3], return_max_logits=True
    )
    ((o.double() * do.double()).sum() + (l.double() * dlse.double()).sum()).backward()
    assert mx.dtype == torch.float32 and torch.isfinite(l).all()
    _close(
        [o, l, mx, *(x.grad for x in xs)], _dense(q, k, v, qr, kr, tm, sink, do, dlse, softcap), "autograd"
    )


def test_launchers_with_sink_dlse_and_max(fake_fa4):
    qr, kr, tm = fake_fa4
    q, k, v, sink, do, dlse = _inputs()
    out, lse, mx = magi_ffa_fa4.ffa_fwd(q, k, v, qr, kr, tm, sink=sink, return_max_logits=True)
    dq, dk, dv, dsink = magi_ffa_fa4.ffa_bwd(do, q, k, v, out, lse, qr, kr, tm, dlse=dlse, sink=sink)
    _close([out, lse, mx, dq, dk, dv, dsink], _dense(q, k, v, qr, kr, tm, sink, do, dlse, 0.0), "launchers")
    # accumulate mode: a first call without keys' contribution, the sink merged by the second
    acc, acc_lse = torch.zeros(q.shape), torch.full((TQ, HQ), float("-inf"))
    magi_ffa_fa4.ffa_fwd(q, k, v, qr, kr, tm, sink=sink, out=acc, lse=acc_lse)
    torch.testing.assert_close(acc.half(), out, rtol=2e-3, atol=2e-3)
    torch.testing.assert_close(acc_lse, lse, rtol=1e-5, atol=1e-5)
