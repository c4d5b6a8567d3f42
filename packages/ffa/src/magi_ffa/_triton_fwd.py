"""Triton forward kernel of FFA and its launcher (no autograd).

One program per (q head, q block). It walks every slice that touches its q block (CSR from ``_meta``), for
each slice only the key blocks the slice's type leaves visible, with element masks only on boundary tiles;
all slices feed one online softmax (exp2, log2e folded into the scale), so overlapping q slices need no
merge pass. Heads sharing a kv head are adjacent program ids (K/V tiles reused from L2). In accumulate mode
the epilogue merges with the caller's (out, lse). Deterministic: a fixed order, no atomics.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._meta import axis_tiles
from ._slice import Slice
from ._triton_common import (
    LN2,
    LOG2E,
    alloc,
    compute_flags,
    dot_,
    load_slice,
    merge_partials,
    qblock_cols,
    tanh_,
    tile_full,
    tile_visible,
    tiles_for,
)


@triton.jit
def ffa_fwd_kernel(
    Q, K, V, O, LSE, SLICES, BLK_PTR, BLK_IDX, BLK_ORDER, SINK_LSE, MAXL,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh,
    stride_ot, stride_oh, stride_lt, stride_lh, stride_mt, stride_mh,
    total_q, sm_scale, softcap,
    GROUP, HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    SOFTCAP: tl.constexpr, ACCUM: tl.constexpr, UPCAST: tl.constexpr, IEEE: tl.constexpr,
    HAS_SINK: tl.constexpr, RET_MAX: tl.constexpr, MAX_ONLY: tl.constexpr,
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
    if UPCAST:
        q = q.to(tl.float32)
    qk_scale = sm_scale * LOG2E
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
    e0 = tl.load(BLK_PTR + blk)
    e1 = tl.load(BLK_PTR + blk + 1)
    for e in range(e0, e1):
        qs, qe, ks, ke, dk, dk_inv, causal, inv = load_slice(SLICES, tl.load(BLK_IDX + e))
        lo, hi, rows_full = qblock_cols(qs, qe, ks, ke, dk, dk_inv, causal, inv, m0, BLOCK_M)
        for n0 in range(lo, hi, BLOCK_N):
            offs_n = n0 + offs_j
            col_ok = offs_n < hi
            kt = tl.load(
                K + offs_n[None, :] * stride_kt + hk * stride_kh + offs_d[:, None],
                mask=col_ok[None, :],
                other=0.0,
            )
            if not MAX_ONLY:  # MAX_ONLY: the row maxima alone (a QK pass, no softmax, no V, no PV)
                vb = tl.load(
                    V + offs_n[:, None] * stride_vt + hk * stride_vh + offs_d[None, :],
                    mask=col_ok[:, None],
                    other=0.0,
                )
            if UPCAST:
                kt = kt.to(tl.float32)
                if not MAX_ONLY:
                    vb = vb.to(tl.float32)
            s = dot_(q, kt, tl.zeros([BLOCK_M, BLOCK_N], tl.float32), IEEE)
            if SOFTCAP:
                s = tanh_(s * (sm_scale / softcap)) * (softcap * LOG2E)
            else:
                s = s * qk_scale
            # boundary tile? (interior tiles of a slice skip the element mask)
            if not tile_full(
                m0, n0, rows_full, n0 + BLOCK_N <= hi, dk, dk_inv, causal, inv, BLOCK_M, BLOCK_N
            ):
                vis = tile_visible(offs_m[:, None], offs_n[None, :], qs, qe, ks, ke, dk, dk_inv, causal, inv)
                s = tl.where(vis & col_ok[None, :], s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1))
            if not MAX_ONLY:
                m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
                p = tl.exp2(s - m_safe[:, None])
                alpha = tl.exp2(m_i - m_safe)
                l_i = l_i * alpha + tl.sum(p, 1)
                acc = dot_(p.to(vb.dtype), vb, acc * alpha[:, None], IEEE)
            m_i = m_new
    if RET_MAX:
        # the row's largest visible scaled (soft-capped) score, natural units; -inf for rows without keys
        tl.store(MAXL + offs_m * stride_mt + pid_h * stride_mh, m_i * LN2, mask=row_ok)
    if not MAX_ONLY:
        pos = l_i > 0
        l_safe = tl.where(pos, l_i, 1.0)
        o = acc / l_safe[:, None]
        lse = tl.where(pos, (m_i + tl.log2(l_safe)) * LN2, float("-inf"))
        if HAS_SINK:
            # the sinks: one more partial result, out 0 and lse logsumexp_t sink[t, h], merged once per row
            # here, before any accumulate-mode merge (the merge is associative)
            ls = tl.load(SINK_LSE + pid_h)
            mx = tl.maximum(lse, ls)
            mx_safe = tl.where(mx == float("-inf"), 0.0, mx)
            w_a = tl.exp(lse - mx_safe)
            tot = w_a + tl.exp(ls - mx_safe)
            has = tot > 0.0
            tot_safe = tl.where(has, tot, 1.0)
            c_a = tl.where(has, w_a / tot_safe, 0.0)
            o = tl.where(c_a[:, None] > 0.0, o * c_a[:, None], 0.0)
            lse = tl.where(has, mx_safe + tl.log(tot_safe), float("-inf"))
        o_ptrs = O + offs_m[:, None] * stride_ot + pid_h * stride_oh + offs_d[None, :]
        l_ptrs = LSE + offs_m * stride_lt + pid_h * stride_lh
        if ACCUM:
            # merge with the caller's partial result; rows at -inf ignore the old out entirely
            lse_prev = tl.load(l_ptrs, mask=row_ok, other=float("-inf"))
            o_prev = tl.load(o_ptrs, mask=row_ok[:, None], other=0.0).to(tl.float32)
            o, lse = merge_partials(o_prev, lse_prev, o, lse)
        tl.store(o_ptrs, o.to(O.dtype.element_ty), mask=row_ok[:, None])
        tl.store(l_ptrs, lse, mask=row_ok)


def _last_dim_contiguous(t: torch.Tensor) -> torch.Tensor:
    return t if t.stride(-1) == 1 else t.contiguous()


def triton_fwd(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    slices: tuple[Slice, ...],
    scale: float,
    softcap: float,
    *,
    out: torch.Tensor | None = None,
    lse: torch.Tensor | None = None,
    sink_lse: torch.Tensor | None = None,
    row_max: torch.Tensor | None = None,
    max_only: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Launch the forward kernel on validated inputs (q ``[total_q, num_heads_q, head_dim]``, k/v ``[total_k,
    num_heads_kv, head_dim]``). ``out``/``lse`` given: merged into in place; else allocated (out in q's dtype,
    lse float32 ``[total_q, num_heads_q]``). ``sink_lse`` (float32 ``[num_heads_q]``): merged into this
    call's result in the epilogue. ``row_max`` (float32 ``[total_q, num_heads_q]``): receives each row's
    largest visible scaled score (-inf without keys); with ``max_only`` nothing else is computed or written
    (out and lse are then returned untouched)."""
    q, k, v = (_last_dim_contiguous(t) for t in (q, k, v))
    tq, hq, d = q.shape
    upcast, ieee = compute_flags(q)
    t = tiles_for("fwd", d, interpret=not q.is_cuda)
    accum = out is not None
    if max_only:
        if row_max is None:
            raise ValueError("max_only needs row_max")
        out = lse = None
    elif not accum:
        out = alloc(q.shape, q.dtype, q.device)
        lse = alloc((tq, hq), torch.float32, q.device)
    if tq == 0:
        return out, lse
    if out is not None and out.stride(-1) != 1:
        raise ValueError("`out` must be contiguous in its last dimension for the triton backend")
    meta = axis_tiles(slices, tq, t.block_m, "q", str(q.device))
    # unused pointers get a valid tensor (never read: their constexpr flag is off)
    o_arg, l_arg = (row_max, row_max) if out is None else (out, lse)
    m_arg = l_arg if row_max is None else row_max
    ffa_fwd_kernel[(hq, meta.num_blocks)](
        Q=q, K=k, V=v, O=o_arg, LSE=l_arg, SLICES=meta.slices, BLK_PTR=meta.ptr, BLK_IDX=meta.idx,
        BLK_ORDER=meta.order, SINK_LSE=l_arg if sink_lse is None else sink_lse, MAXL=m_arg,
        stride_qt=q.stride(0), stride_qh=q.stride(1), stride_kt=k.stride(0), stride_kh=k.stride(1),
        stride_vt=v.stride(0), stride_vh=v.stride(1),
        stride_ot=o_arg.stride(0), stride_oh=o_arg.stride(1),
        stride_lt=l_arg.stride(0), stride_lh=l_arg.stride(1),
        stride_mt=m_arg.stride(0), stride_mh=m_arg.stride(1),
        total_q=tq, sm_scale=scale, softcap=softcap if softcap > 0 else 1.0,
        GROUP=hq // k.shape[1], HEAD_DIM=d, BLOCK_M=t.block_m, BLOCK_N=t.block_n,
        SOFTCAP=softcap > 0, ACCUM=accum and not max_only, UPCAST=upcast, IEEE=ieee,
        HAS_SINK=sink_lse is not None and not max_only, RET_MAX=row_max is not None, MAX_ONLY=max_only,
        num_warps=t.num_warps, num_stages=t.num_stages,
    )  # fmt: skip
    return out, lse
