"""Triton backward kernels of FFA (dq and dkv, split) and their launcher (no autograd).

``ffa_bwd_dq_kernel``: one program per (q head, q block), the forward's walk over slices and key blocks,
accumulating dq in registers. ``ffa_bwd_dkv_kernel``: one program per (kv head, k block), walking the slices
that touch its keys, every q head of its GQA group, and the visible q blocks, accumulating dk and dv in
registers. Each output row block has one owner, so overlapping q or k slices need no atomics and the result
is bitwise deterministic. Gradients use the final lse (``P = exp(S - lse)``) and ``delta = rowsum(do * out)
- dlse``; rows with lse -inf give P = 0. Accumulators are fp32 (added to when given). The dkv kernel's
q-range cut (``kblock_rows``), tile step (``dkv_tile``) and launcher prologue (``bwd_setup``) are shared with
the fused backward (``_triton_bwd_fused``).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._meta import axis_tiles
from ._slice import Slice
from ._triton_common import (
    LOG2E,
    alloc,
    compute_flags,
    dot_,
    load_slice,
    qblock_cols,
    tanh_,
    tile_full,
    tile_visible,
    tiles_for,
)


@triton.jit
def ffa_bwd_dq_kernel(
    Q, K, V, DO, LSE, DELTA, DQ, SLICES, BLK_PTR, BLK_IDX, BLK_ORDER,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_dot, stride_doh,
    stride_lt, stride_lh, stride_dqt, stride_dqh,
    total_q, sm_scale, softcap,
    GROUP, HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    SOFTCAP: tl.constexpr, ACCUM: tl.constexpr, UPCAST: tl.constexpr, IEEE: tl.constexpr,
):  # fmt: skip
    pid_h = tl.program_id(0)
    blk = tl.load(BLK_ORDER + tl.program_id(1))
    hk = pid_h // GROUP
    m0 = blk * BLOCK_M
    offs_m = m0 + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM)
    offs_j = tl.arange(0, BLOCK_N)
    row_ok = offs_m < total_q
    q = tl.load(
        Q + offs_m[:, None] * stride_qt + pid_h * stride_qh + offs_d[None, :], mask=row_ok[:, None], other=0.0
    )
    do = tl.load(
        DO + offs_m[:, None] * stride_dot + pid_h * stride_doh + offs_d[None, :],
        mask=row_ok[:, None],
        other=0.0,
    )
    if UPCAST:
        q = q.to(tl.float32)
        do = do.to(tl.float32)
    lse = tl.load(LSE + offs_m * stride_lt + pid_h * stride_lh, mask=row_ok, other=float("-inf"))
    lse2 = tl.where(lse == float("-inf"), float("inf"), lse * LOG2E)  # empty rows: P = exp2(s - inf) = 0
    delta = tl.load(DELTA + offs_m * stride_lt + pid_h * stride_lh, mask=row_ok, other=0.0)
    qk_scale = sm_scale * LOG2E
    dq = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
    e0 = tl.load(BLK_PTR + blk)
    e1 = tl.load(BLK_PTR + blk + 1)
    for e in range(e0, e1):
        qs, qe, ks, ke, dk, dk_inv, causal, inv = load_slice(SLICES, tl.load(BLK_IDX + e))
        lo, hi, rows_full = qblock_cols(qs, qe, ks, ke, dk, dk_inv, causal, inv, m0, BLOCK_M)
        for n0 in range(lo, hi, BLOCK_N):
            offs_n = n0 + offs_j
            col_ok = offs_n < hi
            kb = tl.load(
                K + offs_n[:, None] * stride_kt + hk * stride_kh + offs_d[None, :],
                mask=col_ok[:, None],
                other=0.0,
            )
            vt = tl.load(
                V + offs_n[None, :] * stride_vt + hk * stride_vh + offs_d[:, None],
                mask=col_ok[None, :],
                other=0.0,
            )
            if UPCAST:
                kb = kb.to(tl.float32)
                vt = vt.to(tl.float32)
            s = dot_(q, tl.trans(kb), tl.zeros([BLOCK_M, BLOCK_N], tl.float32), IEEE)
            if SOFTCAP:
                th = tanh_(s * (sm_scale / softcap))
                s = th * (softcap * LOG2E)
            else:
                s = s * qk_scale
            p = tl.exp2(s - lse2[:, None])
            if not tile_full(
                m0, n0, rows_full, n0 + BLOCK_N <= hi, dk, dk_inv, causal, inv, BLOCK_M, BLOCK_N
            ):
                vis = tile_visible(offs_m[:, None], offs_n[None, :], qs, qe, ks, ke, dk, dk_inv, causal, inv)
                p = tl.where(vis & col_ok[None, :], p, 0.0)
            dp = dot_(do, vt, tl.zeros([BLOCK_M, BLOCK_N], tl.float32), IEEE)
            ds = p * (dp - delta[:, None])
            if SOFTCAP:
                ds = ds * (1.0 - th * th)
            dq = dot_(ds.to(kb.dtype), kb, dq, IEEE)
    dq = dq * sm_scale
    dq_ptrs = DQ + offs_m[:, None] * stride_dqt + pid_h * stride_dqh + offs_d[None, :]
    if ACCUM:
        dq += tl.load(dq_ptrs, mask=row_ok[:, None], other=0.0)
    tl.store(dq_ptrs, dq, mask=row_ok[:, None])


@triton.jit
def kblock_rows(qs, qe, ks, ke, dk, dk_inv, causal, inv, n0, BLOCK_N: tl.constexpr):
    """Rows ``[r_lo, r_hi)`` of one slice that see any key of the k block at ``n0`` (the q range cut by the
    slice type), and whether every key of the block lies inside the slice's k range."""
    c_lo = tl.maximum(ks, n0)
    c_hi = tl.minimum(ke, n0 + BLOCK_N)
    r_lo = tl.where(causal, tl.maximum(qs, c_lo - dk), qs)
    r_hi = tl.where(inv, tl.minimum(qe, c_hi - dk_inv), qe)
    cols_full = (ks <= n0) & (n0 + BLOCK_N <= ke)
    return r_lo, r_hi, cols_full


@triton.jit
def dkv_tile(
    Q, DO, LSE, DELTA, kb, vb, dk_acc, dv_acc, h, m0, n0, r_hi, offs_n, offs_d,
    qs, qe, ks, ke, dk, dk_inv, causal, inv, cols_full,
    stride_qt, stride_qh, stride_dot, stride_doh, stride_lt, stride_lh, sm_scale, softcap,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, SOFTCAP: tl.constexpr, UPCAST: tl.constexpr,
    IEEE: tl.constexpr,
):  # fmt: skip
    """One (k block, q head h, q tile at m0) step of a k-block walk: adds to dk_acc / dv_acc ``[BLOCK_N, d]``
    and returns them with ``dS^T`` ``[BLOCK_N, BLOCK_M]`` (unscaled, zero outside the slice), so a
    fused caller can form this tile's dq. Element masks only when the tile is not inside the slice."""
    offs_m = m0 + tl.arange(0, BLOCK_M)
    row_ok = offs_m < r_hi
    qt = tl.load(
        Q + offs_m[None, :] * stride_qt + h * stride_qh + offs_d[:, None], mask=row_ok[None, :], other=0.0
    )
    do = tl.load(
        DO + offs_m[:, None] * stride_dot + h * stride_doh + offs_d[None, :], mask=row_ok[:, None], other=0.0
    )
    if UPCAST:
        qt = qt.to(tl.float32)
        do = do.to(tl.float32)
    lse = tl.load(LSE + offs_m * stride_lt + h * stride_lh, mask=row_ok, other=float("-inf"))
    lse2 = tl.where(lse == float("-inf"), float("inf"), lse * LOG2E)
    delta = tl.load(DELTA + offs_m * stride_lt + h * stride_lh, mask=row_ok, other=0.0)
    st = dot_(kb, qt, tl.zeros([BLOCK_N, BLOCK_M], tl.float32), IEEE)  # S^T: [keys, rows]
    if SOFTCAP:
        th = tanh_(st * (sm_scale / softcap))
        st = th * (softcap * LOG2E)
    else:
        st = st * (sm_scale * LOG2E)
    pt = tl.exp2(st - lse2[None, :])
    # rows from r_lo >= qs on, so the tile's rows are inside the slice when they end before qe
    if not tile_full(m0, n0, m0 + BLOCK_M <= qe, cols_full, dk, dk_inv, causal, inv, BLOCK_M, BLOCK_N):
        vis = tile_visible(offs_m[None, :], offs_n[:, None], qs, qe, ks, ke, dk, dk_inv, causal, inv)
        pt = tl.where(vis & row_ok[None, :], pt, 0.0)
    dv_acc = dot_(pt.to(do.dtype), do, dv_acc, IEEE)
    dpt = dot_(vb, tl.trans(do), tl.zeros([BLOCK_N, BLOCK_M], tl.float32), IEEE)
    dst = pt * (dpt - delta[None, :])
    if SOFTCAP:
        dst = dst * (1.0 - th * th)
    dk_acc = dot_(dst.to(qt.dtype), tl.trans(qt), dk_acc, IEEE)
    return dk_acc, dv_acc, dst


@triton.jit
def ffa_bwd_dkv_kernel(
    Q, K, V, DO, LSE, DELTA, DK, DV, SLICES, BLK_PTR, BLK_IDX, BLK_ORDER,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_dot, stride_doh,
    stride_lt, stride_lh, stride_dkt, stride_dkh, stride_dvt, stride_dvh,
    total_k, sm_scale, softcap,
    GROUP, HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    SOFTCAP: tl.constexpr, ACCUM: tl.constexpr, UPCAST: tl.constexpr, IEEE: tl.constexpr,
):  # fmt: skip
    hk = tl.program_id(0)
    blk = tl.load(BLK_ORDER + tl.program_id(1))
    n0 = blk * BLOCK_N
    offs_n = n0 + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_DIM)
    col_ok = offs_n < total_k
    kb = tl.load(
        K + offs_n[:, None] * stride_kt + hk * stride_kh + offs_d[None, :], mask=col_ok[:, None], other=0.0
    )
    vb = tl.load(
        V + offs_n[:, None] * stride_vt + hk * stride_vh + offs_d[None, :], mask=col_ok[:, None], other=0.0
    )
    if UPCAST:
        kb = kb.to(tl.float32)
        vb = vb.to(tl.float32)
    dk_acc = tl.zeros([BLOCK_N, HEAD_DIM], tl.float32)
    dv_acc = tl.zeros([BLOCK_N, HEAD_DIM], tl.float32)
    e0 = tl.load(BLK_PTR + blk)
    e1 = tl.load(BLK_PTR + blk + 1)
    for e in range(e0, e1):
        qs, qe, ks, ke, dk, dk_inv, causal, inv = load_slice(SLICES, tl.load(BLK_IDX + e))
        r_lo, r_hi, cols_full = kblock_rows(qs, qe, ks, ke, dk, dk_inv, causal, inv, n0, BLOCK_N)
        for g in range(GROUP):
            h = hk * GROUP + g
            for m0 in range(r_lo, r_hi, BLOCK_M):
                dk_acc, dv_acc, _dst = dkv_tile(
                    Q, DO, LSE, DELTA, kb, vb, dk_acc, dv_acc, h, m0, n0, r_hi, offs_n, offs_d,
                    qs, qe, ks, ke, dk, dk_inv, causal, inv, cols_full,
                    stride_qt, stride_qh, stride_dot, stride_doh, stride_lt, stride_lh, sm_scale, softcap,
                    BLOCK_M, BLOCK_N, SOFTCAP, UPCAST, IEEE,
                )  # fmt: skip
    dk_acc = dk_acc * sm_scale
    dk_ptrs = DK + offs_n[:, None] * stride_dkt + hk * stride_dkh + offs_d[None, :]
    dv_ptrs = DV + offs_n[:, None] * stride_dvt + hk * stride_dvh + offs_d[None, :]
    if ACCUM:
        dk_acc += tl.load(dk_ptrs, mask=col_ok[:, None], other=0.0)
        dv_acc += tl.load(dv_ptrs, mask=col_ok[:, None], other=0.0)
    tl.store(dk_ptrs, dk_acc, mask=col_ok[:, None])
    tl.store(dv_ptrs, dv_acc, mask=col_ok[:, None])


def bwd_setup(
    do: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    lse: torch.Tensor,
    delta: torch.Tensor,
    scale: float,
    softcap: float,
    dq: torch.Tensor | None,
    dk: torch.Tensor | None,
    dv: torch.Tensor | None,
    *,
    zero_dq: bool,
) -> tuple:
    """Shared launcher prologue of the split and fused backward: unit-stride q/k/v/do, one stride pair for
    lse/delta, the constexpr/scalar kwargs common to the kernels, and float32 (dq, dk, dv) buffers (the given
    ones, else fresh: dq zero-filled when ``zero_dq`` since atomics add into it, the rest uninitialised)."""
    q, k, v, do = (t if t.stride(-1) == 1 else t.contiguous() for t in (q, k, v, do))
    delta = delta.contiguous()
    lse = lse if lse.stride() == delta.stride() else lse.contiguous()  # one stride pair for lse and delta
    upcast, ieee = compute_flags(q)
    common = dict(sm_scale=scale, softcap=softcap if softcap > 0 else 1.0, GROUP=q.shape[1] // k.shape[1],
                  HEAD_DIM=q.shape[2], SOFTCAP=softcap > 0, UPCAST=upcast, IEEE=ieee)  # fmt: skip
    bufs = []
    for i, (buf, ref) in enumerate(((dq, q), (dk, k), (dv, v))):
        if buf is not None and buf.stride(-1) != 1:
            raise ValueError("gradient accumulators must be contiguous in the last dimension for triton")
        if buf is None:
            zero = zero_dq and i == 0
            buf = (
                torch.zeros(ref.shape, dtype=torch.float32, device=q.device)
                if zero
                else alloc(ref.shape, torch.float32, q.device)
            )
        bufs.append(buf)
    return q, k, v, do, lse, delta, common, tuple(bufs)


def triton_bwd(
    do: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    lse: torch.Tensor,
    delta: torch.Tensor,
    slices: tuple[Slice, ...],
    scale: float,
    softcap: float,
    *,
    dq: torch.Tensor | None = None,
    dk: torch.Tensor | None = None,
    dv: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Launch dq and dkv kernels on validated inputs. lse/delta float32 ``[total_q, num_heads_q]`` (delta
    already zero on rows with lse -inf). Returns float32 dq/dk/dv: the given buffers (added to) or fresh."""
    q, k, v, do, lse, delta, common, (gq, gk, gv) = bwd_setup(
        do, q, k, v, lse, delta, scale, softcap, dq, dk, dv, zero_dq=False
    )
    tq, hq, d = q.shape
    tk, hk, _ = k.shape
    interp = not q.is_cuda
    if tq and hq:
        t = tiles_for("dq", d, interp)
        meta = axis_tiles(slices, tq, t.block_m, "q", str(q.device))
        ffa_bwd_dq_kernel[(hq, meta.num_blocks)](
            Q=q, K=k, V=v, DO=do, LSE=lse, DELTA=delta, DQ=gq, SLICES=meta.slices, BLK_PTR=meta.ptr,
            BLK_IDX=meta.idx, BLK_ORDER=meta.order,
            stride_qt=q.stride(0), stride_qh=q.stride(1), stride_kt=k.stride(0), stride_kh=k.stride(1),
            stride_vt=v.stride(0), stride_vh=v.stride(1), stride_dot=do.stride(0), stride_doh=do.stride(1),
            stride_lt=delta.stride(0), stride_lh=delta.stride(1), stride_dqt=gq.stride(0), stride_dqh=gq.stride(1),
            total_q=tq, BLOCK_M=t.block_m, BLOCK_N=t.block_n, ACCUM=dq is not None,
            num_warps=t.num_warps, num_stages=t.num_stages, **common,
        )  # fmt: skip
    if tk and hk:
        t = tiles_for("dkv", d, interp)
        meta = axis_tiles(slices, tk, t.block_n, "k", str(q.device))
        ffa_bwd_dkv_kernel[(hk, meta.num_blocks)](
            Q=q, K=k, V=v, DO=do, LSE=lse, DELTA=delta, DK=gk, DV=gv, SLICES=meta.slices, BLK_PTR=meta.ptr,
            BLK_IDX=meta.idx, BLK_ORDER=meta.order,
            stride_qt=q.stride(0), stride_qh=q.stride(1), stride_kt=k.stride(0), stride_kh=k.stride(1),
            stride_vt=v.stride(0), stride_vh=v.stride(1), stride_dot=do.stride(0), stride_doh=do.stride(1),
            stride_lt=delta.stride(0), stride_lh=delta.stride(1), stride_dkt=gk.stride(0), stride_dkh=gk.stride(1),
            stride_dvt=gv.stride(0), stride_dvh=gv.stride(1),
            total_k=tk, BLOCK_M=t.block_m, BLOCK_N=t.block_n, ACCUM=dk is not None,
            num_warps=t.num_warps, num_stages=t.num_stages, **common,
        )  # fmt: skip
    return gq, gk, gv
