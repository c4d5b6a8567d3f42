"""The FA4 varlen path on the CPU: the groups reproduce the mask exactly, and the launchers around FA4's varlen
kernels (one output buffer or merges, pre-filled rows, gradients summed over groups) match dense fp64.

FlashAttention-4 does not run here: a fake ``_flash_attn_fwd`` / ``_flash_attn_bwd`` computes each batch
entry densely with FA4's varlen semantics (``cu_seqlens`` starts, ``seqused`` lengths, a window aligned to
the entry's bottom-right corner, rows of no entry left untouched, NaN where nothing was written).
"""

from __future__ import annotations

import itertools
import os
import random
from types import SimpleNamespace

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import magi_ffa_fa4
from magi_ffa import testing as T
from magi_ffa.validation import host_slices
from magi_ffa_fa4 import _launch_meta, interface
from magi_ffa_fa4.varlen import VarlenGroup, plan_varlen

CPU = torch.device("cpu")


def _entries(g: VarlenGroup):
    cu_q, cu_k = g.cu_seqlens_q.tolist(), g.cu_seqlens_k.tolist()
    n = len(cu_q) - 1
    lq = g.seqused_q.tolist() if g.seqused_q is not None else [cu_q[i + 1] - cu_q[i] for i in range(n)]
    lk = g.seqused_k.tolist() if g.seqused_k is not None else [cu_k[i + 1] - cu_k[i] for i in range(n)]
    return [(cu_q[i], lq[i], cu_k[i], lk[i]) for i in range(n)]


def _window(lq: int, lk: int, left, right) -> torch.Tensor:
    """FA4's local mask of one entry: row i sees j with i + lk - lq - left <= j <= i + lk - lq + right."""
    i = torch.arange(lq)[:, None]
    j = torch.arange(lk)[None, :]
    ok = torch.ones(lq, lk, dtype=torch.bool)
    if right is not None:
        ok &= j <= i + lk - lq + right
    if left is not None:
        ok &= j >= i + lk - lq - left
    return ok


def _group_mask(g: VarlenGroup, tq: int, tk: int) -> torch.Tensor:
    m = torch.zeros(tq, tk, dtype=torch.bool)
    for qs, lq, ks, lk in _entries(g):
        m[qs : qs + lq, ks : ks + lk] |= _window(lq, lk, g.window_left, g.window_right)
    return m


def _docs(total: int, rng: random.Random) -> list[tuple[int, int]]:
    cuts = sorted({0, total, *(rng.randrange(1, total) for _ in range(rng.randrange(0, 5)))})
    return list(itertools.pairwise(cuts))


def _mask_case(kind: str, tq: int, rng: random.Random):
    docs = _docs(tq, rng)
    if kind == "varlen_causal":
        return [list(d) for d in docs], [list(d) for d in docs], [1] * len(docs)
    if kind == "varlen_full":
        return [list(d) for d in docs], [list(d) for d in docs], [0] * len(docs)
    if kind == "sliding_window":
        w = rng.randrange(1, tq)
        return [[0, w], [w, tq]], [[0, w], [1, tq]], [1, 3]
    if kind == "prefix_lm":  # FULL prefix for every row, causal afterwards: two groups sharing query rows
        p = rng.randrange(1, tq)
        return [[0, tq], [p, tq]], [[0, p], [p, tq]], [0, 1]
    if kind == "gaps":  # documents with holes: rows and keys of no entry, one inverse-causal slice
        d = [x for i, x in enumerate(docs) if i % 2 == 0]
        t = [rng.choice([0, 1, 2, 3]) for _ in d]
        return [list(x) for x in d], [list(x) for x in d], t
    raise AssertionError(kind)


KINDS = ["varlen_causal", "varlen_full", "sliding_window", "prefix_lm", "gaps"]


@settings(max_examples=120, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), kind=st.sampled_from(KINDS), total=st.integers(2, 80))
def test_groups_reproduce_the_mask(seed: int, kind: str, total: int) -> None:
    qr, kr, tm = _mask_case(kind, total, random.Random(seed))
    slices = host_slices(*(torch.tensor(x, dtype=torch.int32) for x in (qr, kr, tm)), total, total)
    plan = plan_varlen(slices, total, total, CPU, min_mean_rows=0, max_groups=8)
    assert plan is not None, f"{kind} should group"
    want = T.make_attn_mask(qr, kr, tm, total, total)
    got = torch.zeros_like(want)
    rows_seen = torch.zeros(total, dtype=torch.int64)
    for g in plan.groups:
        m = _group_mask(g, total, total)
        assert not (got & m).any(), "two groups cover the same pair"
        got |= m
        ents = _entries(g)
        for (q0, lq, k0, lk), (q1, _, k1, _) in itertools.pairwise(ents):
            assert q0 + lq <= q1 and k0 + lk <= k1, "entries of a group must be disjoint and ascending"
        for qs, lq, _, _ in ents:
            rows_seen[qs : qs + lq] += 1
    assert torch.equal(got, want)
    assert plan.q_disjoint == bool((rows_seen <= 1).all())
    assert plan.q_covered == bool((rows_seen >= 1).all())


def test_random_slices_fall_back_and_documents_group() -> None:
    qr, kr, tm = T.random_banded_slices(300, 300, seed=1)
    slices = host_slices(qr, kr, tm, 300, 300)
    assert plan_varlen(slices, 300, 300, CPU, min_mean_rows=0, max_groups=2) is None or len(slices) <= 2
    docs = [[0, 700], [700, 1500], [1500, 2048]]
    slices = host_slices(*(torch.tensor(x, dtype=torch.int32) for x in (docs, docs, [1, 1, 1])), 2048, 2048)
    plan = plan_varlen(slices, 2048, 2048, CPU)
    assert plan is not None and len(plan.groups) == 1
    g = plan.groups[0]
    assert (
        g.fa4_kwargs()["causal"] and g.seqused_q is None and g.cu_seqlens_q.tolist() == [0, 700, 1500, 2048]
    )
    # a sliding window's causal head and its band are one windowed entry: one group, FA4's window (511, 0)
    swa = [[0, 512], [512, 2048]], [[0, 512], [1, 2048]], [1, 3]
    slices = host_slices(*(torch.tensor(x, dtype=torch.int32) for x in swa), 2048, 2048)
    (g,) = plan_varlen(slices, 2048, 2048, CPU).groups
    assert (g.q_ranges, g.k_ranges, g.window_left, g.window_right) == (((0, 2048),), ((0, 2048),), 511, 0)
    # two separate pieces that do not make one window (the band shifted by one key) stay two entries
    gap = [[0, 512], [512, 2048]], [[0, 512], [2, 2048]], [1, 3]
    slices = host_slices(*(torch.tensor(x, dtype=torch.int32) for x in gap), 2048, 2048)
    assert plan_varlen(slices, 2048, 2048, CPU) is None
    # tiny entries keep the block-sparse path
    small = [[i, i + 16] for i in range(0, 2048, 16)]
    slices = host_slices(*(torch.tensor(x, dtype=torch.int32) for x in (small, small, [1] * 128)), 2048, 2048)
    assert plan_varlen(slices, 2048, 2048, CPU) is None


# ------------------------------------------------------------------------ the launchers with a fake FA4
def _heads(x: torch.Tensor, hq: int) -> torch.Tensor:
    return x.repeat_interleave(hq // x.shape[1], dim=1)


def _fake_fa4():
    def canon(causal, left, right):
        return (None, 0) if causal else (left, right)

    def fwd(q, k, v, *, softmax_scale, softcap, return_lse, out=None, lse=None, causal=False,
            window_size_left=None, window_size_right=None, cu_seqlens_q, cu_seqlens_k, seqused_q=None,
            seqused_k=None, max_seqlen_q=None, max_seqlen_k=None, **_):  # fmt: skip
        assert return_lse and softcap == 0.0
        left, right = canon(causal, window_size_left, window_size_right)
        hq = q.shape[1]
        o = out if out is not None else torch.full_like(q, float("nan"))
        l = lse if lse is not None else torch.full((hq, q.shape[0]), float("nan"), dtype=torch.float32)
        g = SimpleNamespace(cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k, seqused_q=seqused_q,
                            seqused_k=seqused_k)  # fmt: skip
        for qs, lq, ks, lk in _entries(g):
            m = _window(lq, lk, left, right)
            oe, le = T.ref_attn(q[qs : qs + lq].double(), k[ks : ks + lk].double(), v[ks : ks + lk].double(), m,
                                softmax_scale)  # fmt: skip
            o[qs : qs + lq] = oe.to(o.dtype)
            l[:, qs : qs + lq] = le.t().float()
        return o, l

    def bwd(q, k, v, out, do, lse, *, softmax_scale, softcap, deterministic, dlse=None, dq=None, dk=None,
            dv=None, causal=False, window_size_left=None, window_size_right=None, cu_seqlens_q, cu_seqlens_k,
            seqused_q=None, seqused_k=None, **_):  # fmt: skip
        left, right = canon(causal, window_size_left, window_size_right)
        hq, hk = q.shape[1], k.shape[1]
        gq = dq if dq is not None else torch.full_like(q, float("nan"))
        gk = dk if dk is not None else torch.full_like(k, float("nan"))
        gv = dv if dv is not None else torch.full_like(v, float("nan"))
        g = SimpleNamespace(cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k, seqused_q=seqused_q,
                            seqused_k=seqused_k)  # fmt: skip
        for qs, lq, ks, lk in _entries(g):
            m = _window(lq, lk, left, right)
            qe, ke, ve = (
                x.double()
                for x in (q[qs : qs + lq], _heads(k[ks : ks + lk], hq), _heads(v[ks : ks + lk], hq))
            )
            oe, doe = out[qs : qs + lq].double(), do[qs : qs + lq].double()
            s = torch.einsum("qhd,khd->hqk", qe, ke) * softmax_scale
            p = torch.where(m[None], torch.exp(s - lse[:, qs : qs + lq, None].double()), 0.0)
            delta = (doe * oe).sum(-1).t()
            if dlse is not None:
                delta = delta - dlse[:, qs : qs + lq].double()
            dp = torch.einsum("qhd,khd->hqk", doe, ve)
            ds = p * (dp - delta[..., None])
            gq[qs : qs + lq] = (torch.einsum("hqk,khd->qhd", ds, ke) * softmax_scale).to(q.dtype)
            dke = torch.einsum("hqk,qhd->khd", ds, qe) * softmax_scale
            dve = torch.einsum("hqk,qhd->khd", p, doe)
            gk[ks : ks + lk] = dke.reshape(lk, hk, hq // hk, -1).sum(2).to(k.dtype)
            gv[ks : ks + lk] = dve.reshape(lk, hk, hq // hk, -1).sum(2).to(v.dtype)
        return gq, gk, gv

    return SimpleNamespace(_flash_attn_fwd=fwd, _flash_attn_bwd=bwd)


@pytest.fixture
def fake(monkeypatch):
    monkeypatch.setattr(interface, "_fa4", _fake_fa4)
    # the contract's checks on the CPU in fp32, without an architecture
    dtypes = (torch.float16, torch.bfloat16, torch.float32)
    relaxed = interface.relaxed_capability(architectures="any", device="any", dtypes=dtypes)
    monkeypatch.setattr(interface.BACKEND, "capability", relaxed)
    monkeypatch.setattr(_launch_meta, "plan_varlen", _always_varlen)
    magi_ffa_fa4.clear_launch_cache()
    yield
    magi_ffa_fa4.clear_launch_cache()


def _always_varlen(slices, total_q, total_k, device):
    plan = plan_varlen(slices, total_q, total_k, device, min_mean_rows=0, max_groups=8)
    assert plan is not None
    return plan


@pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1", reason="the merge kernel runs under TRITON_INTERPRET=1"
)
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("hk", [4, 2])
def test_launchers_match_dense(fake, kind: str, hk: int) -> None:
    tq, hq, d = 70, 4, 8
    rng = random.Random(hk * 31 + len(kind))
    qr, kr, tm = _mask_case(kind, tq, rng)
    q, k, v = T.random_qkv(tq, tq, hq, hk, d, torch.float32, seed=hk)
    do = torch.randn(q.shape, generator=torch.Generator().manual_seed(5))
    dlse = torch.randn(tq, hq, generator=torch.Generator().manual_seed(6))
    mask = T.make_attn_mask(qr, kr, tm, tq, tq)
    xs = [x.double().requires_grad_() for x in (q, k, v)]
    o_ref, l_ref = T.ref_attn(*xs, mask)
    ((o_ref * do).sum() + (torch.where(torch.isneginf(l_ref), 0.0, l_ref) * dlse).sum()).backward()
    assert _launch_meta.get_launch_meta(qr, kr, tm, tq, tq, CPU).varlen is not None
    out, lse = magi_ffa_fa4.ffa_fwd(q, k, v, qr, kr, tm)
    torch.testing.assert_close(out.double(), o_ref.detach(), rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(lse.double(), l_ref.detach(), rtol=1e-4, atol=1e-4)
    acc = [torch.zeros(x.shape) for x in (q, k, v)]
    magi_ffa_fa4.ffa_bwd(
        do, q, k, v, out, lse, qr, kr, tm, dq=acc[0], dk=acc[1], dv=acc[2], dlse=dlse.float()
    )
    for name, got, x in zip(("dq", "dk", "dv"), acc, xs):
        torch.testing.assert_close(got.double(), x.grad, rtol=1e-4, atol=1e-4, msg=name)
    # the autograd entry (its backward through the same varlen calls), lse gradient included
    ys = [x.detach().clone().requires_grad_() for x in (q, k, v)]
    o2, l2 = magi_ffa_fa4.flex_flash_attn_func(*ys, qr, kr, tm)
    ((o2 * do).sum() + (torch.where(torch.isneginf(l2), 0.0, l2) * dlse).sum()).backward()
    for name, y, x in zip(("dq", "dk", "dv"), ys, xs):
        torch.testing.assert_close(y.grad.double(), x.grad, rtol=1e-4, atol=1e-4, msg=name)


@pytest.mark.parametrize("window", [(255, 0), (300, 40), (100, None), (None, 17), (2, 3)])
def test_windows_per_document_are_one_entry_each(window) -> None:
    """Packed documents with a sliding window, each decomposed into slices as the runtime's helpers do
    (``magi_mask``'s region decomposition: a causal head, a band and a tail per document): one entry per
    document, the group's window the asked one, and the group reproduces the mask exactly."""
    from magi_mask import decompose_region, tighten_region

    cu = [0, 700, 1900, 2048, 3000]
    left, right = window
    rows = []
    for s, e in itertools.pairwise(cu):  # square documents: the diagonal is key == query
        lo = s - e + 1 if left is None else -left
        hi = e - 1 - s if right is None else right
        rows += decompose_region(tighten_region(s, e, s, e, lo, hi))
    qr, kr, tm = (torch.tensor(x, dtype=torch.int32) for x in (
        [[a, b] for a, b, *_ in rows], [[c, d] for _, _, c, d, _ in rows], [t for *_, t in rows]))  # fmt: skip
    tq = tk = cu[-1]
    slices = host_slices(qr, kr, tm, tq, tk)
    plan = plan_varlen(slices, tq, tk, CPU, min_mean_rows=0)
    assert plan is not None and len(plan.groups) == 1, window
    (g,) = plan.groups
    assert g.q_ranges == tuple(itertools.pairwise(cu)) and g.k_ranges == g.q_ranges
    assert torch.equal(_group_mask(g, tq, tk), T.make_attn_mask(qr, kr, tm, tq, tk))
