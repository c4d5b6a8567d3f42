"""Fused Triton backward of FFA (FA2 style): one kernel instead of the split dq + dkv pair.

``ffa_bwd_fused_kernel``: one program per (kv head, k block) walks the slices listed for its k block (the
same CSR as the dkv kernel), every q head of its GQA group and the visible q tiles of each slice, keeps dk and
dv in fp32 registers, and adds each tile's ``dq = dS K * scale`` into a float32 buffer with ``tl.atomic_add``.
That is 5 GEMMs per tile instead of the split pair's 7 (the split dq kernel recomputes S and dP), but dq's
summation order depends on scheduling: not bitwise reproducible, so it is used only when
``deterministic=False`` and ``MAGI_FFA_BWD_IMPL=fused`` (``_ops.bwd_impl``). The per-tile math and the
q-range cut by slice type are the dkv kernel's own helpers (``kblock_rows``, ``dkv_tile``).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._meta import axis_tiles
from ._slice import Slice
from ._triton_bwd import bwd_setup, dkv_tile, kblock_rows
from ._triton_common import dot_, load_slice, tiles_for


@triton.jit
def ffa_bwd_fused_kernel(
    Q, K, V, DO, LSE, DELTA, DQ, DK, DV, SLICES, BLK_PTR, BLK_IDX, BLK_ORDER,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_dot, stride_doh,
    stride_lt, stride_lh, stride_dqt, stride_dqh, stride_dkt, stride_dkh, stride_dvt, stride_dvh,
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
                dk_acc, dv_acc, dst = dkv_tile(
                    Q, DO, LSE, DELTA, kb, vb, dk_acc, dv_acc, h, m0, n0, r_hi, offs_n, offs_d,
                    qs, qe, ks, ke, dk, dk_inv, causal, inv, cols_full,
                    stride_qt, stride_qh, stride_dot, stride_doh, stride_lt, stride_lh, sm_scale, softcap,
                    BLOCK_M, BLOCK_N, SOFTCAP, UPCAST, IEEE,
                )  # fmt: skip
                # dS^T is zero outside the slice (and on rows >= r_hi), so the tile adds nothing it must not
                offs_m = m0 + tl.arange(0, BLOCK_M)
                dq = dot_(tl.trans(dst.to(kb.dtype)), kb, tl.zeros([BLOCK_M, HEAD_DIM], tl.float32), IEEE)
                tl.atomic_add(
                    DQ + offs_m[:, None] * stride_dqt + h * stride_dqh + offs_d[None, :],
                    dq * sm_scale,
                    mask=(offs_m < r_hi)[:, None],
                    sem="relaxed",
                )
    dk_acc = dk_acc * sm_scale
    dk_ptrs = DK + offs_n[:, None] * stride_dkt + hk * stride_dkh + offs_d[None, :]
    dv_ptrs = DV + offs_n[:, None] * stride_dvt + hk * stride_dvh + offs_d[None, :]
    if ACCUM:
        dk_acc += tl.load(dk_ptrs, mask=col_ok[:, None], other=0.0)
        dv_acc += tl.load(dv_ptrs, mask=col_ok[:, None], other=0.0)
    tl.store(dk_ptrs, dk_acc, mask=col_ok[:, None])
    tl.store(dv_ptrs, dv_acc, mask=col_ok[:, None])


def triton_bwd_fused(
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
    """Launch the fused kernel on validated inputs; same contract as ``triton_bwd``: lse/delta float32
    ``[total_q, num_heads_q]`` (delta zero on rows with lse -inf), returns float32 ``(dq, dk, dv)``: the given
    buffers (added to) or fresh ones (dq zero-filled, since the kernel only adds into it)."""
    q, k, v, do, lse, delta, common, (gq, gk, gv) = bwd_setup(
        do, q, k, v, lse, delta, scale, softcap, dq, dk, dv, zero_dq=True
    )
    tk, hk, d = k.shape
    if tk and hk:
        t = tiles_for("fused", d, not q.is_cuda)
        meta = axis_tiles(slices, tk, t.block_n, "k", str(q.device))
        ffa_bwd_fused_kernel[(hk, meta.num_blocks)](
            Q=q, K=k, V=v, DO=do, LSE=lse, DELTA=delta, DQ=gq, DK=gk, DV=gv, SLICES=meta.slices,
            BLK_PTR=meta.ptr, BLK_IDX=meta.idx, BLK_ORDER=meta.order,
            stride_qt=q.stride(0), stride_qh=q.stride(1), stride_kt=k.stride(0), stride_kh=k.stride(1),
            stride_vt=v.stride(0), stride_vh=v.stride(1), stride_dot=do.stride(0), stride_doh=do.stride(1),
            stride_lt=delta.stride(0), stride_lh=delta.stride(1), stride_dqt=gq.stride(0), stride_dqh=gq.stride(1),
            stride_dkt=gk.stride(0), stride_dkh=gk.stride(1), stride_dvt=gv.stride(0), stride_dvh=gv.stride(1),
            total_k=tk, BLOCK_M=t.block_m, BLOCK_N=t.block_n, ACCUM=dk is not None,
            num_warps=t.num_warps, num_stages=t.num_stages, **common,
        )  # fmt: skip
    return gq, gk, gv
